"""`sglang-ernie55 plan`: numbers from Ernie55Config, the vendor's minimum-GPU table reproduced exactly,
verdicts with reasons, the 1M explanation."""

from __future__ import annotations

import json

import pytest

from sglang_ernie55.checkpoint.spec import KIND_FP8, expected_tensors
from sglang_ernie55.configuration import Ernie55Config, tiny_config
from sglang_ernie55.deploy import memory as M
from sglang_ernie55.deploy.cells import GPUS

FULL = Ernie55Config()

# SERVING.md's table (vendor) + this project's H200 row.
MIN_GPUS = {
    ("b300", "fp8"): 2,
    ("b300", "bf16"): 4,
    ("gb300", "fp8"): 2,
    ("gb300", "bf16"): 4,
    ("b200", "fp8"): 4,
    ("b200", "bf16"): 8,
    ("gb200", "fp8"): 4,
    ("gb200", "bf16"): 8,
    ("h100", "fp8"): 8,
    ("h100", "bf16"): 16,
    ("h200", "fp8"): 4,
    ("h200", "bf16"): 8,
}


def test_minimum_gpu_table_is_the_vendors():
    assert M.minimum_gpu_table(FULL) == MIN_GPUS


def test_one_gpu_fewer_does_not_fit_and_says_why():
    for (g, p), n in MIN_GPUS.items():
        smaller = M.plan(FULL, M.Layout.minimal(GPUS[g], p, n // 2))
        assert not smaller.fits and smaller.reasons, (g, p)
    b200 = M.plan(FULL, M.Layout.minimal(GPUS["b200"], "fp8", 2))
    assert "below the sizing rule" in b200.reasons[0]  # weights fit; the headroom does not
    h100 = M.plan(FULL, M.Layout.minimal(GPUS["h100"], "fp8", 4))
    assert "exceed the 80 GB" in h100.reasons[0]


def test_weights_come_from_the_config():
    counts = FULL.parameter_counts()
    assert sum(t.params for t in M.checkpoint_tensors(FULL)) == counts["total"]
    fp8, bf16 = M.checkpoint_bytes(FULL, "fp8"), M.checkpoint_bytes(FULL, "bf16")
    assert 270e9 < fp8 < 290e9 and 540e9 < bf16 < 580e9  # "FP8 ~280 GB, BF16 ~560 GB"
    # every FP8 Linear weighs 1 byte plus one fp32 scale per 128x128 block
    linear = sum(t.params for t in M.checkpoint_tensors(FULL) if t.kind == KIND_FP8)
    scales = linear - (bf16 - fp8)  # BF16 adds one byte per Linear weight and drops the scales
    assert linear * 4 / 128**2 <= scales <= linear * 4 / 128**2 * 1.05
    assert fp8 > linear  # scales and BF16/FP32 tensors on top of the FP8 bytes
    # a config change moves the plan: fewer experts, lighter weights
    small = Ernie55Config(n_routed_experts=256)
    assert M.checkpoint_bytes(small, "fp8") < fp8 / 1.5


def test_planner_tensors_are_the_checkpoint_spec():
    """The planner weighs the checkpoint's one tensor list, each tensor in the group SGLang shards it by."""
    cfg = tiny_config()
    tensors = M.checkpoint_tensors(cfg)
    assert [(t.name, t.shape, t.kind) for t in tensors] == [
        (name, s.shape, s.kind) for name, s in expected_tensors(cfg).items()
    ]
    group = {t.name: t.group for t in tensors}
    want = {
        "replicated": [
            "model.layers.0.attn_hc.fn",
            "model.layers.1.input_layernorm.weight",
            "model.hc_head.fn",
            "model.norm.weight",
        ],
        "attention": ["model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.2.self_attn.attn_sink"],
        "router": ["model.layers.1.mlp.routers.1.weight", "model.layers.1.mlp.e_score_correction_bias"],
        "ffn": [
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight",
            "model.layers.2.mlp.shared_experts.gate_proj.weight",
            "model.layers.2.mlp.latent_up.weight",
        ],
        "embedding": ["model.embed_tokens.weight"],
        "lm_head": ["lm_head.weight"],
        "echo": ["echo.e_proj.weight", "echo.norm.weight"],
    }
    assert {name: group[name] for names in want.values() for name in names} == {
        name: g for g, names in want.items() for name in names
    }


def test_kv_bytes_per_token():
    fp8 = M.kv_bytes_per_token(FULL, "fp8_e4m3")
    # the pool's allocation: V4 window pages of 149,760 B / 256 tokens, compressed pages 1,728 B / 2 entries
    assert fp8 == {"mla": 656, "indexer": 132, "hca_window": 149_760 / 256, "hca_compressed": 864}
    bf16 = M.kv_bytes_per_token(FULL, "bfloat16")
    assert bf16 == {
        "mla": 2 * (512 + 64),
        "indexer": 2 * 128,
        "hca_window": 2 * 512,
        "hca_compressed": 2 * 512,
    }
    per = M.pool_bytes_per_token(FULL, "fp8_e4m3", speculative=False, swa_ratio=0.1)
    assert per["full"] == pytest.approx(6 * (656 + 132) + 37 * 864 / 128)
    assert per["swa"] == 37 * 585
    spec = M.pool_bytes_per_token(FULL, "fp8_e4m3", speculative=True, swa_ratio=0.1)
    assert spec["swa"] == 38 * 585  # the ECHO draft's window layer
    # ARCHITECTURE.md: one 1M-token sequence ~0.18 GB of HCA, ~5 GB of MLA-DSA
    assert 37 * 584 / 128 * 2**20 == pytest.approx(0.18e9, rel=0.05)
    assert 6 * (656 + 132) * 2**20 == pytest.approx(5.0e9, rel=0.05)
    tiny = M.kv_bytes_per_token(tiny_config(), "fp8_e4m3")
    assert tiny["hca_window"] < 584 and tiny["mla"] < 656  # from the config's dims, not constants


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 1.0])
def test_planner_bytes_are_the_pools(kv, speculative, ratio):
    """The planner's bytes per token are the serving configurator's (`mem_cache.sizing`), and those are what
    the target pool plus the ECHO draft pool allocate for a given full / SWA split."""
    import torch

    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool
    from sglang_ernie55.mem_cache.sizing import kv_bytes, swa_tokens_for

    for cfg in (FULL, tiny_config()):
        b = kv_bytes(cfg, kv, echo=speculative)
        per = M.pool_bytes_per_token(cfg, kv, speculative=speculative, swa_ratio=ratio)
        assert per["per_token"] == pytest.approx(b.per_full_token(ratio))
        assert per["full"] + ratio * per["swa"] == pytest.approx(per["per_token"])
    cfg, page = tiny_config(), 256
    full = 40 * page
    swa = swa_tokens_for(full, ratio, page)
    dt = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    pool = Ernie55TokenToKVPool(full, page, dt, cfg, num_req_slots=3, device="cpu", swa_size=swa)
    got = pool.get_kv_size_bytes()
    if speculative:
        got += EchoDraftKVPool(full, page, dt, cfg, device="cpu", swa_size=swa).get_kv_size_bytes()
    b = kv_bytes(cfg, kv, echo=speculative)
    assert got == b.allocated(full, swa, 3)
    # per token, the allocation is the planner's number up to the padding pages and the fixed request state
    padding = b.allocated(full, swa, 3) - b.allocated(0, 0, 3) - full * b.per_full_token(swa / full)
    assert abs(padding) <= page * (b.per_swa_token() + b.per_full_token(0.0)) + 2 * b.n_hca * b.cmp_row


def test_sharding_follows_the_layout():
    g = GPUS["h100"]
    tp16 = M.plan(FULL, M.Layout(gpu=g, precision="bf16", nodes=2, gpus_per_node=8, tp=16, attn_dp=2))
    dp16 = M.plan(FULL, M.Layout(gpu=g, precision="bf16", nodes=2, gpus_per_node=8, tp=16, attn_dp=16))
    assert tp16.weights["ffn"] == dp16.weights["ffn"]  # FFN over all 16 either way
    assert dp16.weights["attention"] == pytest.approx(8 * tp16.weights["attention"])  # attention TP 1 vs 8
    assert dp16.max_tokens_server > tp16.max_tokens_server  # 16 KV pools instead of 2


def test_concurrency_and_context():
    p = M.plan(
        FULL,
        M.Layout(
            gpu=GPUS["b300"],
            precision="fp8",
            gpus_per_node=2,
            tp=2,
            context_length=1048576,
            chunked_prefill_size=4096,
            max_running_requests=8,
        ),
    )
    assert p.fits
    assert p.max_context_at(1) == 1048576
    big = 10 * p.max_tokens_per_rank // 1048576 + 10
    assert p.max_context_at(big) < 1048576
    assert p.max_concurrency_at(1048576) == p.max_tokens_per_rank // 1048576
    assert 4e9 < p.scratch / 1 < 40e9  # indexer scores of a 4096-token chunk against 1M


def test_plan_cli_cell(cli):
    rc, out, err = cli("plan", "--hardware", "h100", "--precision", "fp8", "--strategy", "balanced")
    assert rc == 0, err
    assert "verdict: FITS" in out and "tp 8 (attention TP 8)" in out
    assert "MLA-DSA x6" in out and "656 B" in out and "HCA     x37" in out


def test_plan_agrees_with_cmd_on_refused_layouts(cli, dp_with_ep):
    """A recipe the model refuses is not planned as FITS: plan plans what `cmd` prints (the same flags without
    --attn-dp-size), saying so; attention DP (at attention TP 1 and 8) is planned as it is."""
    rc, out, err = cli("plan", "--hardware", "h200", "--precision", "fp8", "--strategy", "high-throughput")
    assert rc == 0, err
    first = out.splitlines()[0]
    assert (
        out.startswith("note: this version refuses the recipe: ") and "expert parallelism (--ep 8)" in first
    )
    assert "tp 8 (attention TP 8)" in out and "attention DP" not in out.splitlines()[2]
    assert "verdict: FITS" in out
    rc, out, err = cli("plan", "--hardware", "h200", "--precision", "bf16", "--strategy", "high-throughput")
    assert rc == 0 and not out.startswith("note:") and "attention DP 8" in out and "verdict: FITS" in out, out
    rc, out, _ = cli("plan", "--hardware", "h100", "--precision", "bf16", "--strategy", "high-throughput")
    assert rc == 0 and not out.startswith("note:") and "attention DP 2" in out and "verdict: FITS" in out, out


def test_plan_of_a_cell_with_no_layout_that_runs(cli, no_layout_runs):
    """A cell with no layout that runs is NOT SERVED BY THIS VERSION, exit 1."""
    argv = ("plan", "--hardware", "h100", "--precision", "bf16", "--strategy", "high-throughput")
    rc, out, _ = cli(*argv)
    assert rc == 1 and "verdict: NOT SERVED BY THIS VERSION" in out and "verdict: FITS" not in out
    rc, out, _ = cli(*argv, "--json")
    d = json.loads(out)
    assert rc == 1 and d["servable"] is False and "--attn-dp-size 2" in d["refused"]


def test_plan_cli_does_not_fit_exit_1(cli):
    rc, out, _ = cli("plan", "--hardware", "b200", "--precision", "fp8", "--gpus", "2")
    assert rc == 1 and "DOES NOT FIT" in out and "sizing rule" in out


def test_plan_cli_table_and_json(cli):
    rc, out, _ = cli("plan", "--table")
    assert rc == 0
    rows = {ln.split("(")[0].strip(): ln for ln in out.splitlines()[2:]}
    assert rows["H100"].split()[:2] == ["H100", "(80"] and rows["H100"].endswith("8   16 (2 x 8)")
    rc, out, _ = cli("plan", "--table", "--json")
    assert json.loads(out) == {f"{g}/{p}": n for (g, p), n in MIN_GPUS.items()}


def test_plan_cli_explains_1m(cli):
    rc, out, _ = cli("plan", "--hardware", "b300", "--strategy", "long-context", "--json")
    assert rc == 0
    d = json.loads(out)
    text = " ".join(d["explain_1m"])
    assert "single digits" in text and "--cuda-graph-max-bs-decode" in text and "chunked-prefill-size" in text
    assert d["max_context_at_max_running_requests"] == 1048576 and d["fits"]


def test_plan_cli_overrides_and_errors(cli, tmp_path):
    rc, out, _ = cli("plan", "--hardware", "h200", "--kv-cache-dtype", "bfloat16", "--json")
    assert json.loads(out)["kv_bytes_per_token_per_layer"]["mla"] == 1152
    rc, _, err = cli("plan", "--hardware", "tpu")
    assert rc == 2 and "unknown hardware" in err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config().to_config_json()))
    rc, out, _ = cli("plan", "--config", str(cfg), "--hardware", "h100", "--gpus", "1", "--json")
    assert rc == 0 and json.loads(out)["weights_gb_per_gpu"] < 1
    rc, out, _ = cli("plan", "--help")
    assert "Assumptions" in out and "10% of the GPU" in out and "25%" in out
