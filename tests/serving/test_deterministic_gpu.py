"""GPU suite: `--enable-deterministic-inference` makes greedy output bit-identical across everything that
changes a batch's shape: concurrency, decode CUDA graphs vs eager, radix-cache prefix hits, and ECHO
speculative decoding (steps 1, 2, 3: verify rows instead of decode rows) on or off.

Why this needs its own mode: in the default mode the `ernie55` kernels split each query's keys by the batch's
shape (kernels/sparse_attn.py), cuBLAS picks GEMM algorithms by the token count and FusedMoE its tile config by
it, so the same request rounds differently in different batches; on the tiny random model a 1e-6 difference
can flip a near-tie (the H200 runs of 2026-12-02: prefix-hit rounds identical on 11-13 of 13 prompts, ECHO
steps 2 on 13 of 14). Under SGLang's deterministic inference SGLang swaps in batch-invariant GEMMs
(aten::mm / bmm / mean / log_softmax) and a fixed FusedMoE config, and the `ernie55` backend splits keys in
fixed 256-key chunks per query (never by the batch) and skips FlashMLA.

Servers (tiny BF16 checkpoint, bf16 activations = the serving default, bf16 KV, hybrid SWA pool, all with
`--enable-deterministic-inference`):
  det-eager   --disable-cuda-graph: all prompts concurrently, again (prefix hits), then one at a time;
  det-graph   decode CUDA graphs: all prompts concurrently;
  det-echo-sS ECHO steps S = 1, 2, 3 (draft-decode / verify graphs): all prompts concurrently.
Criterion: every server's greedy tokens equal det-eager's first round on every prompt (prompts cross the
window, the compression blocks and pages; 32 new tokens), logprob differences reported. Sanity: the first
round against the bf16-KV-rounded reference (top-1 >= 80%, as for bf16 activations in test_server_gpu.py: a
deterministic but wrong path would score ~0). Results: $SERVING_LOG_DIR/deterministic-results.jsonl.
"""

from __future__ import annotations

import pytest

from tests.echo import echo_checks
from tests.serving import server_harness as sh

pytestmark = [pytest.mark.gpu]

NEW_TOKENS = 32
COMMON = (
    "--enable-deterministic-inference",
    "--context-length",
    "4096",
    "--max-running-requests",
    "16",
    "--chunked-prefill-size",
    "512",
    "--max-total-tokens",
    "131072",
    "--kv-cache-dtype",
    "bfloat16",
    "--disable-prefill-cuda-graph",
    "--cuda-graph-max-bs-decode",
    "16",
    "--decode-log-interval",
    "1",
    "--mem-fraction-static",
    sh.mem_fraction("0.4"),
)
# --decode-log-interval 1: every decode batch logs "cuda graph: True/False" (the default, every 40 batches,
# printed no line in a short run on the H200, 2026-12-03)
SERVER_TIMEOUT_S = 300
_runs: dict[str, dict] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("det") / "bf16", dtype="bf16", seed=0))


@pytest.fixture(scope="module")
def prompts():
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    return sh.make_prompts(cfg.vocab_size, cfg.bos_token_id)


def _generate(server, prompts, workers: int) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(lambda p: echo_checks.generate(server, p, NEW_TOKENS), prompts))


def _serve(name: str, path: str, prompts, *flags: str, rounds=(("concurrent", 16),)) -> dict:
    server = sh.Server(path, *COMMON, *flags, log_name=name, timeout=SERVER_TIMEOUT_S)
    try:
        out = {r: _generate(server, prompts, w) for r, w in rounds}
        log = server.log_path.read_text(errors="replace")
        impls = server.attention_impls()
    finally:
        server.stop()
    assert impls == {"hca": "triton", "mla_dsa": "triton"}, f"{name}: the backend ran {impls}"
    assert "batch-invariant key splits" in log, f"{name}: the backend did not log its deterministic choice"
    return {"rounds": out, "log": log}


def _compare(name: str, base: list[dict], got: list[dict], prompts) -> dict:
    diffs, lp_max = [], 0.0
    for p, a, b in zip(prompts, base, got):
        if a["tokens"] != b["tokens"]:
            i = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
            diffs.append({"prompt_len": len(p), "first_diff": i})
        else:
            lp_max = max([lp_max] + [abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])])
    rep = {
        "run": name,
        "identical": len(prompts) - len(diffs),
        "of": len(prompts),
        "diffs": diffs,
        "logprob_max_abs_diff_on_identical": lp_max,
    }
    sh.write_report(f"deterministic_{name}", rep)
    print(
        f"\n[deterministic {name}] identical {rep['identical']}/{rep['of']}, logprob max |diff| {lp_max:.3g}, "
        f"diffs {diffs[:4]}"
    )
    return rep


def _base(ckpt, prompts) -> dict:
    if "eager" not in _runs:
        _runs["eager"] = _serve(
            "det-eager",
            ckpt,
            prompts,
            "--disable-cuda-graph",
            rounds=(("concurrent", 16), ("prefix_hit", 16), ("one_by_one", 1)),
        )
    return _runs["eager"]


def test_deterministic_eager_rounds_identical(ckpt, prompts):
    """Concurrent, again as prefix hits, then one request at a time (batch 1 throughout): identical."""
    run = _base(ckpt, prompts)
    base = run["rounds"]["concurrent"]
    assert all(len(o["tokens"]) == NEW_TOKENS for o in base)
    cached = [int(c) for c in __import__("re").findall(r"Prefill batch.*?#cached-token: (\d+)", run["log"])]
    assert max(cached, default=0) >= 256, "the second round hit no cached prefix"
    for r in ("prefix_hit", "one_by_one"):
        rep = _compare(f"eager_{r}", base, run["rounds"][r], prompts)
        assert rep["identical"] == rep["of"], rep
        assert rep["logprob_max_abs_diff_on_identical"] == 0.0, rep
    # sanity: deterministic and right (bf16 activations: the loose bound of test_server_gpu.py)
    _, ref = sh.load_reference(ckpt, "cpu")
    with sh.kv_rounded_reference("bfloat16", queries=True):
        s = sh.score(ref, prompts, base, "cpu")
    print(f"[deterministic eager] vs the bf16-KV-rounded reference: {s.summary()}")
    sh.write_report("deterministic_eager_vs_reference", {"summary": s.summary()})
    assert s.top1 >= 0.8 * s.positions, s.summary()


def test_deterministic_decode_graphs_identical(ckpt, prompts):
    base = _base(ckpt, prompts)["rounds"]["concurrent"]
    run = _serve("det-graph", ckpt, prompts)
    assert " cuda graph: True" in run["log"], "no decode step ran in a CUDA graph"
    rep = _compare("graph", base, run["rounds"]["concurrent"], prompts)
    assert rep["identical"] == rep["of"], rep
    assert rep["logprob_max_abs_diff_on_identical"] == 0.0, rep


@pytest.mark.parametrize("steps", [2, 1, 3])
def test_deterministic_echo_identical(ckpt, prompts, steps):
    """ECHO on: the target verifies S+1 rows per request instead of decoding one, the accepted tokens must be
    exactly the no-ECHO server's (greedy speculative decoding is lossless; here also bit for bit)."""
    base = _base(ckpt, prompts)["rounds"]["concurrent"]
    run = _serve(
        f"det-echo-s{steps}",
        ckpt,
        prompts,
        *echo_checks.spec_flags(steps),
    )
    got = run["rounds"]["concurrent"]
    rep = _compare(f"echo_s{steps}", base, got, prompts)
    verify = sum(o["meta"].get("spec_verify_ct", 0) for o in got)
    print(f"[deterministic echo s{steps}] verify rounds {verify} for {len(got) * NEW_TOKENS} tokens")
    assert verify > 0, "no speculative verify ran"
    assert rep["identical"] == rep["of"], rep
