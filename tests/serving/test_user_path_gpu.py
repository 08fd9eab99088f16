"""The user's path on the GPU: `sglang serve --model-path X` with no tuning flag, and the memory it takes.

- SGLang's pool set-up, in-process, for the sizes our configurator returns: the device bytes it allocates
  (`torch.cuda.memory_allocated` before and after: request table, target pool, SWA allocator, ECHO draft pool)
  stay within the plan, and the plan within the budget; bf16 / fp8 KV, ECHO on / off, 128K and 1M contexts.
- `sglang serve --model-path X` alone (SGLang's memory defaults, the model's defaults) on three checkpoints:
  the tiny preset, a geometry of another shape (routed to bf16 KV and the torch attention path), the
  full-width reduced-depth FP8 checkpoint: each starts, plans within its budget, and answers; the start-up
  prefill warm-up leaves no Triton compile to the first long prompt.
- The torch attention path with CUDA graphs and ECHO at a 1M-token context: graph capture stays small (it used
  to gather the whole context per row), and the greedy tokens equal the KV-rounded reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.serving import geometries as geo
from tests.serving import server_harness as sh
from tests.serving import sizing_harness as szh

pytestmark = [pytest.mark.gpu]
GiB = 1 << 30
REF_DEVICE = "cpu"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    import json

    from sglang_ernie55.configuration import tiny_config

    d = tmp_path_factory.mktemp("tiny-config")
    (d / "config.json").write_text(json.dumps(tiny_config().to_config_json()))
    return str(d)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("context", ["131072", "1048576"])
def test_pool_set_up_allocates_within_budget(tiny_dir, kv, echo, context):
    flags = ["--kv-cache-dtype", kv, "--context-length", context]
    if echo:
        flags += ["--speculative-algorithm", "EAGLE"]
    if context == "1048576":
        flags += ["--max-running-requests", "8"]
    budget = 12 * GiB
    b = szh.build_like_sglang(tiny_dir, *flags, budget=budget, device="cuda")
    plan = b.planned
    exact = plan["pool"] + plan["req_to_token"] + plan["allocator"]
    print(
        f"\n[pool budget {kv} echo={echo} ctx={context}] allocated {b.allocated / GiB:.3f} GiB, tensors "
        f"{exact / GiB:.3f}, plan {sum(plan.values()) / GiB:.3f}, budget {budget / GiB:.0f}; "
        f"full {b.sizes.max_total_num_tokens} swa {b.sizes.swa_max_total_num_tokens}"
    )
    assert exact <= b.allocated <= sum(plan.values()) <= budget, (b.allocated, plan)
    # the budget is used, not left idle: all of it planned, and what is not allocated here is the eager
    # runner's inputs (allocated later by SGLang) and the allocator's rounding
    assert sum(plan.values()) >= 0.99 * budget, plan
    assert b.allocated + plan["eager_inputs"] + plan["rounding"] >= 0.97 * budget, (b.allocated, plan)
    del b
    torch.cuda.empty_cache()


def _budget_line(log: str) -> tuple[float, float]:
    m = re.search(r"ERNIE-5.5 pool sizing: .* planned=([\d.]+) GiB .* budget=([\d.]+) GiB", log)
    assert m, "no pool sizing line with a budget in the server log"
    return float(m.group(1)), float(m.group(2))


class SimpleCfg:
    def __init__(self, vocab_size: int, bos_token_id: int):
        self.vocab_size, self.bos_token_id = vocab_size, bos_token_id


@pytest.fixture(scope="module")
def full_width_dir(tmp_path_factory) -> str:
    """The 4-layer full-width FP8 checkpoint (about 22 GB), written once for the module's tests."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("full-width")
    return str(
        make_checkpoint(root / "full-width", preset="full-width", dtype="fp8", layers=4, device="cuda")
    )


def _checkpoint(kind: str, root: Path, request: pytest.FixtureRequest | None) -> tuple[str, object]:
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    if kind == "tiny":
        return str(make_checkpoint(root / "tiny", dtype="bf16", seed=0)), geo.BY_NAME["tiny"].config()
    if kind == "odd":
        v = geo.BY_NAME["odd_mla_dims"]
        return geo.write_checkpoint(v, root), v.config()
    return request.getfixturevalue("full_width_dir"), None


@pytest.mark.parametrize("kind", ["tiny", "odd", "full-width"])
def test_default_launch_serves(tmp_path, request, kind):
    """`sglang serve --model-path X`, nothing else: starts, plans its pool within SGLang's budget, answers."""
    path, cfg = _checkpoint(kind, tmp_path, request)
    server = sh.Server(path, log_name=f"default-{kind}", cli=True, timeout=900)
    try:
        vocab, bos = (cfg.vocab_size, cfg.bos_token_id) if cfg is not None else (103424, 1)
        prompts = geo.prompts(SimpleCfg(vocab, bos))
        outs = server.complete_all(prompts, 16)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    planned, budget = _budget_line(log)
    print(
        f"\n[default {kind}] startup {server.startup_s:.0f}s, planned {planned} GiB of {budget} GiB; "
        f"attention {server.attention_impls()}; cmd {' '.join(server.cmd[:3])}"
    )
    assert planned <= budget
    assert "OutOfMemoryError" not in log
    # the prefill warm-up ran by default, before the server reported healthy
    assert re.search(r"prefill warm-up: 1 prompt\(s\) of \d+ tokens", log) and "prefill warm-up done" in log
    assert all(len(o["tokens"]) == 16 for o in outs)
    if cfg is None:
        return
    kv = "bfloat16" if geo.BY_NAME["odd_mla_dims" if kind == "odd" else "tiny"].fp8_kv else "fp8_e4m3"
    assert f"kv={kv}" in log, f"the pool should run {kv} KV"
    rcfg, ref = sh.load_reference(path, REF_DEVICE)
    with sh.kv_rounded_reference(kv, rcfg, queries=True):
        s = sh.score(ref, prompts, outs, REF_DEVICE)
    print(f"[default {kind}] bf16 activations, {kv} KV vs the KV-rounded fp32 reference: {s.summary()}")
    assert s.top1 >= 0.8 * s.positions, s.summary()  # bf16 activations (unmodelled): a broken path scores ~0


def test_first_long_prompt_compiles_nothing(full_width_dir):
    """`sglang serve --model-path X` on the full-width checkpoint: the start-up prefill warm-up compiles what
    a long prompt of another shape launches (three chunks over cached prefixes, an odd remainder), so SGLang's
    late-compile watch logs nothing once the server has reported healthy (its threshold set to 0 here)."""
    path = full_width_dir
    env = {"SGLANG_TRITON_SLOW_COMPILE_THRESHOLD_SECS": "0"}
    server = sh.Server(path, log_name="first-long-prompt", cli=True, timeout=900, env=env)
    try:
        ready = len(server.log_path.read_text(errors="replace"))
        n = 3 * 8192 + 1003  # SGLang's default chunk on this GPU is 8192 (checked below)
        out = server.complete([1] + [(7 * i) % 100_000 + 2 for i in range(n - 1)], 2)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "'chunked_prefill_size': 8192" in log
    assert "prefill warm-up done" in log[:ready]
    late = re.findall(r"Triton kernel '(\w+)' took ([\d.]+) s to compile after serving started", log[ready:])
    print(f"\n[first long prompt] {n} tokens served; compiles after ready: {late}")
    assert len(out["tokens"]) == 2
    assert not late, late


def test_torch_path_graphs_and_echo_at_1m_context(tmp_path):
    """The case that asked for 252 GiB in decode-graph capture: the torch attention path, CUDA graphs on, ECHO
    steps 2, 1M-token context. Graph capture stays small and the tokens equal the KV-rounded reference."""
    path, cfg = _checkpoint("tiny", tmp_path, None)
    server = sh.Server(
        path,
        "--context-length",
        "1048576",
        "--max-running-requests",
        "4",
        "--cuda-graph-max-bs-decode",
        "4",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        log_name="torch-1m-echo",
        cli=True,
        timeout=900,
        env={"SGLANG_ERNIE55_ATTN_IMPL": "torch"},
    )
    prompts = geo.prompts(cfg)
    try:
        outs = server.complete_all(prompts, 24, workers=4)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    graphs = [float(x) for x in re.findall(r"Capture .*? end\..*?mem usage=([\d.]+) GB", log)]
    print(f"\n[torch 1M ECHO] graph captures mem usage {graphs} GB; attention {server.attention_impls()}")
    assert graphs, "no CUDA graph was captured"
    assert max(graphs) < 4.0, graphs
    assert server.attention_impls() == {"hca": "torch", "mla_dsa": "torch"}
    rcfg, ref = sh.load_reference(path, REF_DEVICE)
    with sh.kv_rounded_reference("bfloat16", rcfg):
        s = sh.score(ref, prompts, outs, REF_DEVICE)
    print(f"[torch 1M ECHO] {s.summary()}")
    assert s.top1 >= 0.99 * s.positions and s.mean_lp_err <= 0.005, (s.summary(), s.mismatches)
