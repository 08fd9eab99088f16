"""GPU suite: a real SGLang server (`python -m sglang.launch_server`, what `sglang serve` runs) on tiny
BF16 / FP8 checkpoints made here, concurrent /v1/completions (temperature 0, logprobs), compared with
the reference model in fp32 (teacher-forced over the server's own tokens, scored on the host).

The oracle rounds exactly where the server rounds, and nowhere else (server_harness):
- KV: the tensors the pool stores go through the pool's own codec (bf16, or the fp8 byte layouts with
  their scales: `kv_rounded_reference(kv_dtype)`);
- FP8 weights: the checkpoint's dequantised weights (the loader), and every Linear that SGLang serves with
  its FP8 block method gets its input quantised per token and group of 128 as SGLang does
  (`fp8_activation_reference`; the set of those Linears is checked against the SGLang model on CPU).
- the `ernie55` backend's default compute (SGLANG_ERNIE55_ATTN_IMPL=auto: the Triton kernels here; the tiny
  geometry does not fit FlashMLA; every server's log is checked for what it ran) takes its MMA operands in the
  activations' precision: with `--dtype float32` every dot runs in IEEE fp32 (queries, keys, softmax weights),
  so the oracle is the KV-only one, as for the torch twin; with bf16 / fp16 activations it reads the HCA
  query, the MLA query and the indexer query in bf16 and the oracle rounds those three as well
  (`kv_rounded_reference(..., queries=True)`, all of them except the absorbed MLA query q_nope W_uk), while
  the bf16 softmax weights stay unmodelled. The H200 run of 2026-12-03 (bf16 operands at fp32 activations)
  showed why the exactness runs need fp32 operands: 408/416 top-1 with gaps up to 0.83 nats, since the
  attention's ~1e-3 relative bf16 noise flips DSA top-k near-ties (index_topk 64) in the next MLA layer.
  `bf16_kv_group_twin` runs the torch twin (SGLANG_ERNIE55_ATTN_IMPL=torch) against the KV-only oracle:
  the stage-1 baseline (415/416 on the H200).
With `--dtype float32` nothing else rounds except FusedMoE's Triton kernel, which computes fp32 inputs in
fp16; the criteria allow for that with a near-tie margin. The tiny random model amplifies
perturbations ~9x (docs/checkpoints.md), so bf16 activations (rounded at every op, which no oracle
here models) are reported against a loose bound only.

| test | weights / activations / KV | criterion |
| --- | --- | --- |
| bf16_kv | BF16 / fp32 / bf16 | every greedy token the oracle's top-1 up to a near-tie of TIE_NATS; logprob abs error max <= 0.05, mean <= 0.005; again as whole-page prefix hits |
| bf16_kv_group_twin | same, torch twin, KV-only oracle | same |
| decode_cuda_graphs | same, decode graphs on | same; identity with the eager server reported |
| bf16_weights_fp8_kv | BF16 / fp32 / fp8_e4m3 | first token = oracle top-1 up to 0.05 nats on every prompt; top-1 >= 95% of positions; mean logprob abs error <= 0.01 |
| fp8_weights_fp8_kv | FP8 / fp16 / fp8_e4m3 | at the noise floor: top-1 >= the oracle's agreement with itself under fp16-rounded FP8 inputs minus 10 points, mean logprob error <= 1.5x its own + 0.02 (SGLang refuses fp32 activations for FP8 weights; fp16 is the least noisy dtype it takes, and each rounding can move an activation across an FP8 quantisation step: `server_harness.fp8_noise_floor`) |
| bf16_activations | BF16 / bf16 / bf16 | reported; top-1 >= 80% (a broken path scores ~0) |
| fp8_production | FP8 / bf16 / fp8_e4m3, graphs | the FP8 noise floor at bf16 (`fp8_noise_floor(act_dtype=bf16)`), as fp8_weights_fp8_kv |

Two groups can run in parallel on one GPU (each server takes 40% of its memory):
`-k bf16_kv_group` and `-k fp8_group`. Results: $SERVING_LOG_DIR/serving-results.jsonl.

Every server runs over SGLang's hybrid-SWA pool (SWATokenToKVPoolAllocator + the SWA radix cache; checked
in its log, the pool facts printed and reported as `pool_<name>`): the SWA pool is
--swa-full-tokens-ratio 0.1 of the full pool by default; the decode-graph server uses 0.02 (2560 SWA
tokens for 131072 full ones, below the prompts' total) so that SWA eviction and prefix hits on partly
evicted prefixes run under CUDA graphs.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from tests.serving import server_harness as sh

pytestmark = [pytest.mark.gpu]

NEW_TOKENS = 32
# The reference scores on the host: reference.functional builds some index tensors on the CPU
# (hca_compress_block's position, hca_visible_mask's arange), so its forward fails on CUDA inputs.
REF_DEVICE = "cpu"
TIE_NATS = 0.01
KERNEL = {
    "hca": "triton",
    "mla_dsa": "triton",
}  # auto on CUDA at the tiny geometry (FlashMLA needs 512 / 576)
TWIN = {"hca": "torch", "mla_dsa": "torch"}
COMMON = (
    "--context-length",
    "4096",
    "--max-running-requests",
    "32",
    "--chunked-prefill-size",
    "512",
    "--max-total-tokens",
    "131072",
    "--sampling-backend",
    "pytorch",
    "--disable-prefill-cuda-graph",
    "--mem-fraction-static",
    sh.mem_fraction("0.4"),
)
_results: dict[str, list] = {}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {fmt: str(make_checkpoint(root / fmt, dtype=fmt, seed=0)) for fmt in ("bf16", "fp8")}


@pytest.fixture(scope="module")
def prompts():
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    return sh.make_prompts(cfg.vocab_size, cfg.bos_token_id)


def _serve(path, *args, name, impls=KERNEL):
    env = {"SGLANG_ERNIE55_ATTN_IMPL": "torch" if impls == TWIN else "auto"}
    server = sh.Server(path, *COMMON, *args, log_name=name, env=env)
    try:
        first = server.complete_all(PROMPTS_HOLDER["p"], NEW_TOKENS)
        again = server.complete_all(PROMPTS_HOLDER["p"], NEW_TOKENS)  # whole-page prefix hits
    finally:
        server.stop()
    sh.write_report(f"raw_{name}", {"prompts": PROMPTS_HOLDER["p"], "first": first, "again": again})
    pool = _swa_pool_facts(server.log_path.read_text(errors="replace"))
    print(f"\n[{name}] {pool}")
    sh.write_report(f"pool_{name}", pool)
    assert pool["hybrid_swa"] and pool["swa_tokens"], pool  # the SWA pool is what the server ran on
    got = server.attention_impls()
    assert got == impls, f"{name}: the backend ran {got}, expected {impls} (server log {server.log_path})"
    return first, again, server.startup_s


def _swa_pool_facts(log: str) -> dict:
    """What the server's log says about the pool: SGLang's tree cache kind, our pool line, the prefix hits."""
    import re

    m = re.search(r"ERNIE-5.5 KV pool: full_tokens=(\d+) swa_tokens=(\w+)", log)
    cached = [int(c) for c in re.findall(r"Prefill batch.*?#cached-token: (\d+)", log)]
    return {
        "hybrid_swa": "hybrid_swa=True" in log,
        "full_tokens": int(m.group(1)) if m else None,
        "swa_tokens": int(m.group(2)) if m and m.group(2).isdigit() else None,
        "max_cached_tokens": max(cached, default=0),
        "prefills_with_hits": sum(c > 0 for c in cached),
    }


PROMPTS_HOLDER: dict = {}


def _oracle(ref, cfg, kv: str, fp8_weights: bool, bf16_queries: bool = True) -> ExitStack:
    """bf16_queries: the server's kernels read the queries in bf16 (the kernel path at bf16 / fp16 activations;
    at fp32 activations its dots are IEEE fp32 and, like the torch twin, it rounds only the KV)."""
    stack = ExitStack()
    stack.enter_context(sh.kv_rounded_reference(kv, cfg, queries=bf16_queries))
    if fp8_weights:
        stack.enter_context(sh.fp8_activation_reference(ref, cfg))
    return stack


def _scored(ckpt, kv, fp8_weights, prompts, *outs, bf16_queries: bool = False):
    cfg, ref = sh.load_reference(ckpt, REF_DEVICE)
    with _oracle(ref, cfg, kv, fp8_weights, bf16_queries):
        return [sh.score(ref, prompts, o, REF_DEVICE) for o in outs]


def _identical(a, b) -> int:
    return sum(x["tokens"] == y["tokens"] for x, y in zip(a, b))


def _track(name, s, s_again, first, again, t):
    same = _identical(first, again)
    print(f"\n[{name}, startup {t:.0f}s] {s.summary()}; mismatches {s.mismatches[:4]}")
    print(f"[{name}] prefix-hit round identical {same}/{len(first)}; vs oracle {s_again.summary()}")
    sh.write_report(
        name,
        {
            "summary": s.summary(),
            "mismatches": s.mismatches,
            "prefix_hit_identical": same,
            "of": len(first),
            "again": s_again.summary(),
        },
    )


# mean |logprob error| bound of the fp8-KV criteria: the kernel path's attention takes bf16 MMA operands (P, V)
# that no oracle here models; the first H200 run (2026-12-02, BF16 weights + fp8 KV) measured 0.022 with
# top-1 96.4% and every first token; 0.05 bounds that, and a wrong path lands far above (first tokens differ)
def _assert_tracks(s, near: float = 0.05, top1: float = 0.95, mean_lp: float = 0.05):
    firsts = [m for m in s.mismatches if m["pos"] == 0 and m["gap"] > near]
    assert not firsts, f"first token differs beyond a near-tie of {near} nats: {firsts}"
    assert s.top1 >= top1 * s.positions, s.summary()
    assert s.mean_lp_err <= mean_lp, s.summary()


# ---------------------------------------------------------------- group 1: bf16 KV, exact up to near-ties
def test_bf16_kv_group_identical_to_reference(ckpts, prompts):
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["bf16"],
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        "--disable-cuda-graph",
        name="bf16-f32-eager",
    )
    _results["eager"] = first
    s, s_again = _scored(ckpts["bf16"], "bfloat16", False, prompts, first, again)
    _, ref = sh.load_reference(ckpts["bf16"], REF_DEVICE)
    plain = sh.score(ref, prompts, first, REF_DEVICE)
    print(f"[bf16/f32 eager] vs the unrounded fp32-KV reference: {plain.summary()}")
    _track("bf16_f32_eager", s, s_again, first, again, t)
    assert all(len(o["tokens"]) == NEW_TOKENS for o in first)
    for sc in (s, s_again):
        assert sc.worst_gap <= TIE_NATS, sc.mismatches
        assert sc.max_lp_err <= 0.05 and sc.mean_lp_err <= 0.005, sc.summary()


def test_bf16_kv_group_twin_identical_to_reference(ckpts, prompts):
    """The torch twin (SGLANG_ERNIE55_ATTN_IMPL=torch) in the real server, fp32 queries: the KV-only oracle."""
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["bf16"],
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        "--disable-cuda-graph",
        name="bf16-f32-eager-twin",
        impls=TWIN,
    )
    s, s_again = _scored(ckpts["bf16"], "bfloat16", False, prompts, first, again)
    _track("bf16_f32_eager_twin", s, s_again, first, again, t)
    for sc in (s, s_again):
        assert sc.worst_gap <= TIE_NATS, sc.mismatches
        assert sc.max_lp_err <= 0.05 and sc.mean_lp_err <= 0.005, sc.summary()


def test_bf16_kv_group_decode_cuda_graphs(ckpts, prompts):
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["bf16"],
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "bfloat16",
        "--cuda-graph-max-bs-decode",
        "16",
        "--swa-full-tokens-ratio",
        "0.02",
        name="bf16-f32-graph",
    )
    eager = _results.get("eager")
    s, s_again = _scored(ckpts["bf16"], "bfloat16", False, prompts, first, again)
    _track("bf16_f32_graph", s, s_again, first, again, t)
    if eager:
        same = _identical(first, eager)
        print(f"[bf16/f32 decode graphs] identical to the eager server: {same}/{len(eager)}")
        sh.write_report("bf16_f32_graph_vs_eager", {"identical": same, "of": len(eager)})
    for sc in (s, s_again):
        assert sc.worst_gap <= TIE_NATS, sc.mismatches
        assert sc.max_lp_err <= 0.05 and sc.mean_lp_err <= 0.005, sc.summary()


def test_bf16_kv_group_bf16_activations(ckpts, prompts):
    """BF16 weights, bf16 KV, bf16 activations (the serving default dtype): reported, loose bound."""
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["bf16"], "--kv-cache-dtype", "bfloat16", "--disable-cuda-graph", name="bf16-bf16-eager"
    )
    s, s_again = _scored(ckpts["bf16"], "bfloat16", False, prompts, first, again, bf16_queries=True)
    _track("bf16_bf16_eager", s, s_again, first, again, t)
    assert s.top1 >= 0.8 * s.positions, s.summary()


# ---------------------------------------------------------------- group 2: fp8 KV and FP8 weights
def test_fp8_group_act_quant_equals_sglang_cuda_kernel():
    """The oracle's activation quantisation is SGLang's CUDA per-token-group FP8 kernel, bit for bit."""
    from sglang.kernels.ops.quantization.fp8_kernel import per_token_group_quant_fp8

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(300, 512, generator=g) * torch.logspace(-3, 2, 512)).to(dtype)
        x[7] = 0
        q, sc = per_token_group_quant_fp8(x.cuda().contiguous(), 128, column_major_scales=False)
        got = (q.float().view(300, 4, 128) * sc.float().view(300, 4, 1)).view(300, 512).cpu()
        want = sh.fp8_act_quant(x)
        diff = (got != want).float().mean().item()
        print(f"\n[fp8 act quant {dtype}] codes differing from SGLang's CUDA kernel: {diff:.2e}")
        assert diff <= 1e-4, diff


def test_fp8_group_bf16_weights_fp8_kv(ckpts, prompts):
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["bf16"],
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--disable-cuda-graph",
        name="bf16-f32-fp8kv",
    )
    s, s_again = _scored(ckpts["bf16"], "fp8_e4m3", False, prompts, first, again)
    _track("bf16_f32_fp8kv", s, s_again, first, again, t)
    _assert_tracks(s)
    _assert_tracks(s_again)


def test_fp8_group_fp8_weights_fp8_kv(ckpts, prompts):
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(
        ckpts["fp8"],
        "--dtype",
        "float16",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--fp8-gemm-backend",
        "triton",
        "--disable-cuda-graph",
        name="fp8-f16-fp8kv",
    )
    s, s_again = _scored(ckpts["fp8"], "fp8_e4m3", True, prompts, first, again, bf16_queries=True)
    _track("fp8_f16_fp8kv", s, s_again, first, again, t)
    cfg, ref = sh.load_reference(ckpts["fp8"], REF_DEVICE)
    floor = sh.fp8_noise_floor(ref, cfg, prompts, first, REF_DEVICE)
    print(f"[fp8_f16_fp8kv] noise floor (the oracle vs itself with fp16-rounded FP8 inputs): {floor}")
    sh.write_report("fp8_f16_fp8kv_noise_floor", floor)
    # FP8 activation quantisation turns any rounding-level difference into whole 6% code steps and the random
    # tiny model amplifies them (H200 2026-12-03: server 72.6% top-1, mean |lp err| 0.158; the oracle against
    # itself with fp16-rounded inputs 79.1%, 0.133): the server must sit at that floor, a broken FP8 path
    # (wrong scales, wrong layer set) lands near 0% and at several nats
    for sc in (s, s_again):
        assert sc.top1 >= (floor["top1"] - 0.10) * sc.positions, (sc.summary(), floor)
        assert sc.mean_lp_err <= 1.5 * floor["mean_lp"] + 0.02, (sc.summary(), floor)


def test_fp8_group_production_dtypes(ckpts, prompts):
    """FP8 weights, fp8 KV, bf16 activations, decode CUDA graphs: what `sglang serve` runs by default."""
    PROMPTS_HOLDER["p"] = prompts
    first, again, t = _serve(ckpts["fp8"], "--cuda-graph-max-bs-decode", "16", name="fp8-default")
    s, s_again = _scored(ckpts["fp8"], "fp8_e4m3", True, prompts, first, again, bf16_queries=True)
    _track("fp8_default", s, s_again, first, again, t)
    # the noise floor at bf16 (as fp8_weights_fp8_kv at fp16): H200 2026-12-03 (run 1, the old fixed bound of
    # 80%) measured 71.4% top-1 here while the oracle agrees with itself on only ~79% under fp16 rounding
    cfg, ref = sh.load_reference(ckpts["fp8"], REF_DEVICE)
    floor = sh.fp8_noise_floor(ref, cfg, prompts, first, REF_DEVICE, act_dtype=torch.bfloat16)
    print(f"[fp8_default] noise floor (the oracle vs itself with bf16-rounded FP8 inputs): {floor}")
    sh.write_report("fp8_default_noise_floor", floor)
    assert s.top1 >= (floor["top1"] - 0.10) * s.positions, (s.summary(), floor)
    assert s.mean_lp_err <= 1.5 * floor["mean_lp"] + 0.02, (s.summary(), floor)
