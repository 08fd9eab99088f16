"""PD disaggregation on one CUDA GPU: the real-server scenarios of tests/serving/test_pd_cpu.py, with SGLang's own
CUDA paths (no shims).

Run: `GPU_DIR=.gpu-pd bash scripts/gpu-suite.sh tests/serving/test_pd_gpu.py` (with `.gpu-pd/` and
`.peers/mooncake.tar.xz` staged by scripts/stage-mooncake.sh), or `python3 -m pytest -m gpu
tests/serving/test_pd_gpu.py` where SGLang and Mooncake's CUDA build (`mooncake-transfer-engine`) are installed.
pytest's `-s` shows the report lines of passing tests; SERVING_LOG_DIR=DIR keeps the server logs and the results.

A prefill and a decode server (`--disaggregation-mode prefill|decode --disaggregation-transfer-backend mooncake`)
share the GPU with a single server of the same flags through `--mem-fraction-static` (each pool capped at 8192
tokens, so three servers start at once); Mooncake runs over TCP on loopback (`pd_harness.MOONCAKE_TCP`).
tests/serving/pd_harness.py sends each request to both PD servers, as SGLang's router does (not installed on
the GPU machine), so the decode server's own answer is seen. Tiny BF16 checkpoint, fp32 activations.

- `test_pd_servers_give_a_single_servers_tokens[bfloat16|fp8_e4m3]`: 7 prompts of 19-700 tokens (past the
  128-token window; all but the 512-token one end inside a compression block, so the handoff carries open-block
  state), one alone then six at once, 8 greedy tokens each: the decode server's tokens equal the single
  server's, 56/56, logprobs within 1e-3, and score against the KV-rounded reference exactly as the single
  server's do. Both run `--enable-deterministic-inference`: on the GPU the rounding otherwise follows the batch's
  shape (GEMM algorithms, FusedMoE tiles, attention splits; test_deterministic_gpu.py) and the PD batches are not
  the single server's, so a near-tie of the random model could flip. bf16 KV runs decode CUDA graphs on the single
  and the decode server (checked in their logs), fp8 KV runs eagerly. With bf16 KV the prefill server is then
  stopped while a request sent to the decode server alone waits for its KV: the decode server answers it with an
  error naming the lost prefill peer, its pool returns to the idle usage, `/health` stays OK, and with a new
  prefill server on the same bootstrap port it gives the single server's tokens again; the pool returns to idle
  after the last request. SGLang's heartbeat (2 s) and deferred-release wait (5 s) are shortened through its own
  environment variables to keep the run short.
- `test_pd_servers_with_echo_match_a_single_echo_server`: ECHO (EAGLE, 2 steps) on both PD servers and on the
  single server, ECHO-exact checkpoint, bf16 KV: 4 prompts x 10 tokens equal the reference's and the single ECHO
  server's, every draft is accepted, and the decode server's draft extends after its verifies give the single
  server's hidden states (the draft's window rows arrived).
Results: one `[pd gpu ...]` line per test and $SERVING_LOG_DIR/serving-results.jsonl (`pd_gpu_<case>`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.echo import echo_checks
from tests.serving import pd_harness as ph
from tests.serving import server_harness as sh
from tests.serving.test_pd_cpu import (
    LENGTHS,
    NEW_TOKENS,
    _draft_extends_vs_single,
    _generate,
    _idle,
    _lose_the_prefill_server,
    _prompts,
)

NO_MOONCAKE = ph.mooncake_missing()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        NO_MOONCAKE is not None,
        reason="needs the CUDA build of Mooncake's transfer engine (`pip install mooncake-transfer-engine`, or "
        f".peers/mooncake.tar.xz from scripts/stage-mooncake.sh for scripts/gpu-suite.sh): {NO_MOONCAKE}",
    ),
]

REF_DEVICE = "cpu"  # the reference builds some index tensors on the CPU (test_server_gpu.py)
SERVER_TIMEOUT_S = 300
# three servers (single, prefill, decode) on one GPU at once: each pool is capped by --max-total-tokens, and
# SGLang's KV budget (free memory minus (1 - fraction) of the free memory at its start) stays positive while the
# others hold their few GB
MEM_FRACTION = "0.15"
ECHO_TOKENS = 10
SPEC = echo_checks.spec_flags(2)
# SGLang's decode side: a heartbeat every 2 s (its minimum; 2 misses = a lost peer) and 5 s (not 30 s) before it
# frees the pages of a request aborted mid-transfer whose prefill side never acks the drain
FAST_FAILURE = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
}
# the single server's top-1 against the KV-rounded reference: deterministic inference runs its GEMMs as SGLang's
# batch-invariant Triton kernels (TF32 dots for fp32 inputs), which the oracle does not model; a broken path scores
# near 0
SANE_TOP1 = 0.75


def _flags(kv: str, *, deterministic: bool, decode_graphs: bool) -> list[str]:
    """test_pd_cpu.py's server flags on CUDA (8192-token pool, SWA ratio 0.5, 512-token chunks, pytorch sampler),
    8 running requests, prefill CUDA graphs off; decode graphs on (a prefill server turns them off for its role)
    or every graph off."""
    out = ["--dtype", "float32", "--kv-cache-dtype", kv, "--max-total-tokens", "8192"]
    out += ["--max-running-requests", "8", "--swa-full-tokens-ratio", "0.5", "--chunked-prefill-size", "512"]
    out += ["--sampling-backend", "pytorch", "--disable-prefill-cuda-graph"]
    out += ["--mem-fraction-static", sh.mem_fraction(MEM_FRACTION)]
    if deterministic:
        out.append("--enable-deterministic-inference")
    # --decode-log-interval 1: every decode batch logs whether it ran in a CUDA graph
    out += ["--decode-log-interval", "1"] if decode_graphs else ["--disable-cuda-graph"]
    return out


def _single_and_pair(path, flags, name: str, *, env=None, single_env=None, decode_env=None):
    """A single server and a prefill + decode pair with the same flags, started at once (a start is mostly
    SGLang's own start-up and kernel compiles, which overlap); whichever started is stopped if the other fails."""
    with ThreadPoolExecutor(2) as ex:
        futures = [
            ex.submit(
                sh.Server,
                path,
                *flags,
                log_name=f"{name}-single",
                env=single_env,
                timeout=SERVER_TIMEOUT_S,
            ),
            ex.submit(
                ph.PDPair,
                path,
                *flags,
                env=env or {},
                decode_env=decode_env,
                log_name=name,
                timeout=SERVER_TIMEOUT_S,
            ),
        ]
        started, errors = [], []
        for f in futures:
            try:
                started.append(f.result())
            except Exception as e:  # stop the other one before raising
                errors.append(e)
    if errors:
        for s in started:
            s.stop()
        raise errors[0]
    return started


def _scores(path, cfg, kv: str, prompts, *outs):
    _, ref = sh.load_reference(path, REF_DEVICE)
    with sh.kv_rounded_reference(kv, cfg):
        return [sh.score(ref, prompts, o, REF_DEVICE) for o in outs]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("pd-gpu") / "bf16", dtype="bf16", seed=0))


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_pd_servers_give_a_single_servers_tokens(tiny_ckpt, kv):
    """The decode server's greedy tokens for the 7 LENGTHS prompts (one alone, then six at once) are the single
    server's, 56/56, logprobs within 1e-3, with the single server's score against the KV-rounded reference; bf16
    KV: decode CUDA graphs ran on both, and a lost prefill peer aborts the waiting request with an error naming
    it, frees its pages and the pair serves the single server's tokens again with a new prefill server."""
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    prompts = _prompts(cfg, LENGTHS)
    graphs = lost_prefill = kv == "bfloat16"
    flags = _flags(kv, deterministic=True, decode_graphs=graphs)
    t0 = time.time()
    single, pair = _single_and_pair(tiny_ckpt, flags, f"pd-gpu-{kv}", env=FAST_FAILURE)
    up_s = time.time() - t0
    failure, again = {}, None
    try:
        try:
            single_outs = [_generate(single.url, prompts[0])]
            with ThreadPoolExecutor(8) as ex:
                single_outs += list(ex.map(lambda p: _generate(single.url, p), prompts[1:]))
        finally:
            single.stop()
        idle = ph.loads(pair.decode.url)["num_used_tokens"]
        t1 = time.time()
        outs = [pair.generate(prompts[0], NEW_TOKENS)]
        outs += pair.generate_all(prompts[1:], NEW_TOKENS)
        serve_s = time.time() - t1
        if lost_prefill:
            failure = _lose_the_prefill_server(pair, prompts[-1], idle)
            again = pair.generate(prompts[3], NEW_TOKENS)
        # the decode server frees a finished request's pages once the prefill server acks the transfer's drain
        idle_again_s = _idle(pair.decode.url, idle, 120, "after the last request")
        decode_log = pair.decode.log_path.read_text(errors="replace")
    finally:
        pair.stop()
    single_log = single.log_path.read_text(errors="replace")
    s, s_single = _scores(tiny_ckpt, cfg, kv, prompts, outs, single_outs)
    n = len(prompts) * NEW_TOKENS
    same = sum(a == b for o, x in zip(outs, single_outs) for a, b in zip(o["tokens"], x["tokens"]))
    lp_diff = max(abs(a - b) for o, x in zip(outs, single_outs) for a, b in zip(o["logprobs"], x["logprobs"]))
    report = {
        "startup_s": round(up_s),
        "serve_s": round(serve_s, 1),
        "tokens_equal_to_single": f"{same}/{n}",
        "max_logprob_diff_to_single": lp_diff,
        "pd_vs_reference": s.summary(),
        "single_vs_reference": s_single.summary(),
        "decode_cuda_graphs": {
            "single": "cuda graph: True" in single_log,
            "decode": "cuda graph: True" in decode_log,
        },
        "idle_used_tokens": idle,
        "idle_again_s": round(idle_again_s, 1),
        **failure,
    }
    if again is not None:
        report["again_equal_to_single"] = again["tokens"] == single_outs[3]["tokens"]
    print(f"\n[pd gpu {kv}] {report}")
    sh.write_report(f"pd_gpu_{kv}", report)
    assert all(len(o["tokens"]) == NEW_TOKENS for o in outs + single_outs), report
    assert same == n, report
    assert lp_diff <= 1e-3, report
    assert s.top1 == s_single.top1 and s.mismatches == s_single.mismatches, (s.summary(), s_single.summary())
    assert s_single.top1 >= SANE_TOP1 * s_single.positions, s_single.summary()
    if graphs:
        assert all(report["decode_cuda_graphs"].values()), report
    if lost_prefill:
        lost = "Lost connection with prefill instance"
        assert failure["status"] >= 500 and lost in failure["error"], failure
        assert failure["used_while_waiting"] > idle, failure  # the waiting request held pages
        assert failure["used_after_abort"] == idle, (idle, failure)
        assert report["again_equal_to_single"], report


def test_pd_servers_with_echo_match_a_single_echo_server(tmp_path):
    """ECHO (2 draft steps) on both PD servers and on a single server, ECHO-exact checkpoint, bf16 KV, eager: the
    decode server's 4 x 10 greedy tokens are the reference's and the single ECHO server's, every draft it proposes
    is accepted, and its draft extends after each verify (over window rows the prefill server wrote and sent) give
    the single server's hidden states for the same tokens and positions, within 1e-4."""
    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.reference.echo import write_echo_exact_checkpoint

    path, _ = write_echo_exact_checkpoint(tmp_path / "exact", seed=0)
    cfg = tiny_config()
    prompts = _prompts(cfg, (19, 126, 254, 300), seed=1)
    flags = _flags("bfloat16", deterministic=False, decode_graphs=False) + list(SPEC)
    single_dump, decode_dump = tmp_path / "single", tmp_path / "decode"
    single_dump.mkdir()
    decode_dump.mkdir()
    t0 = time.time()
    single, pair = _single_and_pair(
        path,
        flags,
        "pd-gpu-echo",
        single_env={"SGLANG_ERNIE55_ECHO_DUMP_DIR": str(single_dump)},
        decode_env={"SGLANG_ERNIE55_ECHO_DUMP_DIR": str(decode_dump)},
    )
    up_s = time.time() - t0
    try:
        try:
            single_outs = [echo_checks.generate(single, p, ECHO_TOKENS) for p in prompts]
        finally:
            single.stop()
        outs = [pair.generate(p, ECHO_TOKENS, meta=True) for p in prompts]
    finally:
        pair.stop()
    (s,) = _scores(path, cfg, "bfloat16", prompts, outs)
    metas = [o["meta"] for o in outs]
    matched, total, diff = _draft_extends_vs_single(decode_dump, single_dump)
    report = {
        "startup_s": round(up_s),
        "summary": s.summary(),
        "tokens_equal_to_single": [o["tokens"] == x["tokens"] for o, x in zip(outs, single_outs)],
        "drafts": [(m.get("spec_num_correct_drafts"), m.get("spec_num_proposed_drafts")) for m in metas],
        "accept_length": [m.get("spec_accept_length") for m in metas],
        "single_accept_length": [x["meta"].get("spec_accept_length") for x in single_outs],
        "decode_draft_extends": f"{matched} matched of {total}",
        "max_hidden_diff_to_single": diff,
    }
    print(f"\n[pd gpu echo] {report}")
    sh.write_report("pd_gpu_echo", report)
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert all(o["tokens"] == x["tokens"] for o, x in zip(outs, single_outs)), report
    assert all(m.get("spec_verify_ct", 0) >= 1 for m in metas), metas
    assert all(m["spec_num_correct_drafts"] == m["spec_num_proposed_drafts"] for m in metas), metas
    assert matched >= 3 * len(prompts), report  # 3 verify rounds per request, each followed by an extend
    assert diff <= 1e-4, report
