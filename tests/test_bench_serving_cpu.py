"""benchmarks/bench_serving.py on the CPU: its flags, the weight-byte roofline from a checkpoint's headers, the
table, and `--cpu-smoke` end to end (real `sglang.launch_server` servers, SGLang's own client, the plain
server and the ECHO-exact one) where every run completes every prompt with every token asked for."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serving as bsv
from benchmarks.bench_step import experts_hit

ROOT = Path(__file__).resolve().parents[1]


def test_flags_refuse_what_cannot_run(capsys):
    for argv, word in (
        (["--configs", "base,eagle3"], "eagle3"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--concurrency", "0"], "--concurrency"),
        (["--echo-steps", "0"], "--echo-steps"),
    ):
        with pytest.raises(SystemExit) as e:
            bsv.parse_args(argv)
        assert e.value.code == 2 and word in capsys.readouterr().err, argv
    a = bsv.parse_args(["--cpu-smoke", "--server-arg", "--tp 2", "--server-arg=--x"])
    assert a.concurrency == [1, 2] and a.server_arg == ["--tp", "2", "--x"] and a.configs == list(bsv.CONFIGS)
    a = bsv.parse_args([])
    assert (a.concurrency, a.input_len, a.output_len) == ([1, 16, 64], 1024, 1024)


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("bsv") / "fp8", dtype="fp8", seed=3)


def test_weight_bytes_split_the_checkpoint(tiny_fp8):
    """Every stored byte is counted once: fixed + routed experts + (embedding + ECHO, left out) = the shards'
    tensor bytes; one expert entry per MoE layer."""
    from safetensors import safe_open

    from sglang_ernie55.checkpoint.loader import read_config

    cfg = read_config(tiny_fp8)
    w = bsv.weight_bytes(tiny_fp8)
    total = skipped = 0
    for f in tiny_fp8.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                total += t.numel() * t.element_size()
                if name.startswith(("model.embed_tokens.", "echo.")):
                    skipped += t.numel() * t.element_size()
    assert w["fixed"] + sum(w["experts_per_layer"]) + skipped == total
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace)
    assert len(w["experts_per_layer"]) == moe_layers and min(w["experts_per_layer"]) > 0
    assert (w["E"], w["k"]) == (cfg.n_routed_experts, cfg.num_experts_per_tok)


def test_roofline_reads_the_experts_the_batch_touches(tiny_fp8):
    w = bsv.weight_bytes(tiny_fp8)
    E, k, ex = w["E"], w["k"], sum(w["experts_per_layer"])
    for batch in (1, 2, 64):
        step, tok_s = bsv.roofline_tok_s(w, batch, bw=1e12)
        assert step == pytest.approx(w["fixed"] + ex * experts_hit(E, k, batch) / E)
        assert tok_s == pytest.approx(batch * 1e12 / step)
    assert bsv.roofline_tok_s(w, 10**6, 1.0)[0] == pytest.approx(w["fixed"] + ex)  # every expert


def test_table_has_a_row_per_run():
    row = dict(
        stamp="s",
        device="d",
        sglang="v",
        checkpoint="c",
        copy_bytes_per_s=2e12,
        echo_steps=0,
        workload="random",
        concurrency=4,
        prompts=8,
        completed=8,
        output_throughput=100.0,
        median_ttft_ms=1.0,
        p99_ttft_ms=2.0,
        median_tpot_ms=3.0,
        median_itl_ms=4.0,
        p99_itl_ms=5.0,
        accept_length=None,
        config="base",
        roofline_tok_s=400.0,
    )
    echo = dict(row, config="echo-exact", echo_steps=2, accept_length=2.87, roofline_tok_s=None)
    text = bsv.table([row, echo])
    assert "| base | random | 4 | 8 | 8 | 100.0 |" in text and "| 400 | 0.25 |" in text
    assert "| echo-exact x2 | random |" in text and "| 2.87 | - | - |" in text
    long = dict(row, workload="long-prompt", concurrency=1, roofline_tok_s=None, median_ttft_ms=120.0)
    long["prefill_flop_floor_ms"] = 40.0
    assert "| - | - | 40.0 | 3.0 |" in bsv.table([long])


def test_profile_table_lists_idle_by_range():
    """The prefill profile's table: a row per component with time, then the device's idle stretches by range
    (host late / launched before), the largest named; without idle rows (a host trace) only the components."""
    from benchmarks.bench_step import COMPONENT_KEYS

    comps = dict.fromkeys(COMPONENT_KEYS, 0.0) | {"hca": 2.0, "mhc": 1.0}
    p = dict(
        tokens=64,
        e2e_ms=5.0,
        device=True,
        trace="t.json.gz",
        span_ms=4.0,
        busy_ms=3.0,
        gaps_ms=1.0,
        components=comps,
        items_per_component=dict.fromkeys(COMPONENT_KEYS, 1),
        top_kernels={"hca": [["k_hca", 2.0]], "mhc": [["k_mhc", 1.0]]},
        idle_by_range={"mhc": dict(host_late_ms=0.6, launched_before_ms=0.1, stretches=3)},
        idle_largest=[dict(ms=0.4, range="mhc", next="k_mhc", host_late=True)],
    )
    text = bsv.profile_table(p, 2.0)
    assert "| mhc | 3 | 0.60 | 0.10 |" in text and "0.40 ms before k_mhc (mhc, host late)" in text
    assert "k_hca 2.00" in text
    p.update(idle_by_range={}, idle_largest=[])
    assert "Device idle" not in bsv.profile_table(p, None)


def test_one_token_ttft_is_the_end_to_end_latency():
    """A one-token answer whose text is empty (a random token may decode to none) leaves SGLang's client TTFT
    at 0: the long-prompt row then reads the end-to-end latency, the client's figure kept beside it."""
    res = dict(median_ttft_ms=0.0, median_e2e_latency_ms=405.9, p99_e2e_latency_ms=406.5)
    assert bsv.one_token_ttft(res) == dict(client_median_ttft_ms=0.0, median_ttft_ms=405.9, p99_ttft_ms=406.5)
    args = bsv.workloads(bsv.parse_args(["--cpu-smoke"]))
    assert all("--flush-cache" in r["args"] for r in args if r["workload"] != "shared-prefix")


def test_runs_without_a_text_chunk_report_no_timings():
    """A client run whose chunks carried no text reports TTFT / ITL 0 and a TPOT holding the prefill: shown as
    not measured. A run with a TTFT keeps its figures, and so does one that completed nothing."""
    blind = dict(
        completed=1,
        median_ttft_ms=0.0,
        p99_ttft_ms=0.0,
        median_itl_ms=0.0,
        p99_itl_ms=0.0,
        median_tpot_ms=3.76,
    )
    got = bsv.unmeasured_timings(blind)
    assert got["median_ttft_ms"] is None and got["median_tpot_ms"] is None and got["p99_itl_ms"] is None
    assert "not measured" in got["timings"]
    assert bsv.unmeasured_timings(blind | {"median_ttft_ms": 345.0, "median_itl_ms": 1.4}) == {}
    assert bsv.unmeasured_timings(blind | {"completed": 0}) == {}


def test_prefill_flops_count_every_matrix_and_each_positions_attention(tiny_fp8):
    """The Linears' FLOPs are 2 x T x each stored matrix (experts at k/E, the LM head once, no embedding, ECHO
    layer or scales), read here from the shards themselves; one more prompt token adds those per-token FLOPs and
    each layer's attention at the new token's key count; the attention formula at a few key counts by hand."""
    from safetensors import safe_open

    from benchmarks.bench_step import attention_flops
    from sglang_ernie55.checkpoint.loader import read_config
    from sglang_ernie55.configuration import LAYER_HCA

    cfg = read_config(tiny_fp8)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_token = head = 0.0
    for f in tiny_fp8.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                t = h.get_slice(name)
                shape = t.get_shape()
                if (
                    len(shape) < 2
                    or name.startswith(("model.embed_tokens.", "echo."))
                    or name.endswith("scale_inv")
                ):
                    continue
                n = 2.0 * float(math.prod(shape))
                if name.startswith("lm_head."):
                    head += n
                else:
                    per_token += n * (k / E if ".mlp.experts." in name else 1.0)
    T = 200
    a, b = bsv.prefill_flops(tiny_fp8, T - 1), bsv.prefill_flops(tiny_fp8, T)
    attn_T = sum(attention_flops(cfg, kind, T) for kind in cfg.layer_types)
    assert sum(b.values()) - sum(a.values()) == pytest.approx(per_token + attn_T, rel=1e-9)
    attn_all = sum(attention_flops(cfg, kind, L) for kind in cfg.layer_types for L in range(1, T + 1))
    assert sum(b.values()) == pytest.approx(T * per_token + head + attn_all, rel=1e-9)
    assert b["fp8"] > 0 and b["bf16"] > 0  # FP8 Linears at the fp8 rate; attention (and BF16 weights) at bf16
    h, d, w, r = cfg.num_attention_heads, cfg.head_dim, cfg.window_size, cfg.compress_ratio
    for L in (1, w, 3 * w + 5):
        assert attention_flops(cfg, LAYER_HCA, L) == 4.0 * h * d * (min(L, w) + L // r)
    qk, kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    L = cfg.index_topk + 7
    want = 2.0 * cfg.index_n_heads * cfg.index_head_dim * L + 2.0 * h * cfg.index_topk * (qk + kv)
    assert attention_flops(cfg, "mla_dsa", L) == want
    assert bsv.flop_floor_ms(
        {"fp8": 2e12, "bf16": 1e12, "fp32": 0.0}, {"fp8": 2e15, "bf16": 1e15, "fp32": 1.0}
    ) == (pytest.approx(2.0))


@pytest.mark.slow
def test_cpu_smoke(tmp_path):
    """The plain server (random prompts at concurrency 2, the shared-prefix workload and the long prompts) and
    the ECHO-exact one (2 draft steps), each through SGLang's client: every prompt completes with all its
    tokens."""
    from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        # the ECHO CPU server's two stand-ins (tests/echo/test_echo_server_cpu.py says why)
        TRITON_INTERPRET="1",
        PYTHONPATH=shim_pythonpath(ROOT / "tests" / "echo" / "cpu_spec_shim"),
    )
    cmd = [sys.executable, "benchmarks/bench_serving.py", "--cpu-smoke", "--configs", "base,echo-exact"]
    cmd += ["--concurrency", "2", "--out", str(out), "--work", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    log = proc.stdout[-6000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    rows = [json.loads(ln) for ln in (out / bsv.RESULT_FILE).read_text().splitlines()]
    want = [
        ("base", "random"),
        ("base", "shared-prefix"),
        ("base", "long-prompt"),
        ("echo-exact", "random"),
        ("echo-exact", "shared-prefix"),
    ]
    assert [(r["config"], r["workload"]) for r in rows] == want, log
    for r in rows:
        per = 1 if r["workload"] == "long-prompt" else 8  # the smoke's output lengths
        assert r["completed"] == r["prompts"] and r["total_output_tokens"] == per * r["prompts"], r
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0, r
    assert rows[0]["roofline_tok_s"] > 0 and rows[0]["step_weight_bytes"] > 0
    assert rows[2]["prefill_tokens"] == 300 and rows[2]["prefill_flop_floor_ms"] > 0
    prof = rows[2]["prefill_profile"]  # the profiled prompt: the model's ranges reached SGLang's trace
    assert prof["e2e_ms"] > 0 and prof["busy_ms"] > 0 and (out / prof["trace"]).is_file(), prof
    assert prof["components"]["hca"] > 0 and prof["components"]["moe.experts"] > 0, prof
    assert all("prefill_profile" not in r for r in rows if r["workload"] != "long-prompt")
    assert "ECHO draft attached:" in (out / "server-echo-exact.log").read_text()
    assert (tmp_path / "work" / "tiny-echo-exact" / "echo_exact.json").is_file()
    md = (out / bsv.TABLE_FILE).read_text()
    assert md.count("| base |") == 3 and md.count("| echo-exact x2 |") == 2, md
    assert "Prefill profile, one prompt of 300 tokens" in md and "| HCA attention + compression |" in md, md


def test_echo_exact_copy_is_reused_only_for_its_own_base(tmp_path):
    """The ECHO-exact copy is current for the random checkpoint it was made from, and stale once that checkpoint
    is written again (another seed); a base without a recipe (a user's checkpoint) is always copied again."""
    from sglang_ernie55.checkpoint.tiny import RECIPE_FILE, make_checkpoint
    from sglang_ernie55.reference.echo import echo_exact_copy

    base, exact = tmp_path / "tiny", tmp_path / "tiny-echo-exact"
    make_checkpoint(base, dtype="bf16", force=True, reuse=True)
    assert not bsv.exact_is_current(base, exact)
    echo_exact_copy(base, exact, force=True)
    assert bsv.exact_is_current(base, exact) and not (exact / RECIPE_FILE).exists()
    make_checkpoint(base, dtype="bf16", seed=2, force=True, reuse=True)
    assert not bsv.exact_is_current(base, exact)
    (base / RECIPE_FILE).unlink()
    assert not bsv.exact_is_current(base, exact)
