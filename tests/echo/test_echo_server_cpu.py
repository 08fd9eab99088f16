"""A whole ECHO speculative round through SGLang's real EAGLE v2 worker, on CPU: a `--device cpu` server
(`python -m sglang.launch_server ... --speculative-algorithm EAGLE`) on the tiny checkpoints, fp32
activations, bf16 KV.

Everything is SGLang's and ours as in a GPU server (scheduler, EAGLEWorkerV2 + EagleDraftWorker, the
target's TARGET_VERIFY through the `ernie55` backend, the draft's prefill / decode / DRAFT_EXTEND_V2 through
the ECHO backend and pool, the weight-sharing hook, SGLang's greedy acceptance), except two things this
environment lacks (CUDA graphs aside):
- SGLang's speculative helper kernels are Triton (cache locations, chain tree, commit): they run in Triton's
  interpreter (TRITON_INTERPRET=1);
- SGLang builds and verifies the EAGLE tree on a CPU device only through sgl-kernel CPU ops
  (`build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`, behind SGLANG_USE_CPU_ENGINE=1) that the
  installed sglang-kernel does not carry; `cpu_spec_shim/sitecustomize.py` routes those two calls to SGLang's
  own Triton versions of them (its XPU path).

The target's and the draft's window rows live in the SWA pool (SGLang's hybrid allocator, ratio 0.5).

Criteria: greedy tokens equal the reference's (bf16-KV-rounded, teacher-forced: the oracle of
tests/serving/test_server_cpu.py), logprobs within 0.02; the prompts and generated tokens cross the
128-token window / compression block and the 256-token page. Random weights: ~every draft is rejected
(rejection, re-verify and draft-extend rewrite across the boundaries); the ECHO-exact checkpoint: every
draft is accepted (accept length = steps + 1 per round); the draft path's dumps equal the reference's
streams and `echo_forward`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_ernie55.configuration import tiny_config  # noqa: E402
from tests.echo import echo_checks
from tests.serving import server_harness as sh
from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

SHIM = Path(__file__).resolve().parent / "cpu_spec_shim"
# both CPU shims (this one and tests/serving/cpu_tp_shim) for a server of several ranks
TP_SHIM = Path(__file__).resolve().parent / "cpu_spec_tp_shim"
NEW_TOKENS = 10
FLAGS = sh.cpu_flags(
    context_length=2048,
    swa_full_tokens_ratio="0.5",
    chunked_prefill_size=256,
    disable_cuda_graph=True,
    disable_prefill_cuda_graph=True,
    sampling_backend="pytorch",
)


def _serve(path, steps: int, name: str, dump: Path, monkeypatch, layout: tuple[str, ...] = ()):
    """layout: parallel flags (`--tp 2 --attn-dp-size 2`): two ranks, one core each, both CPU shims."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shim = TP_SHIM if layout else SHIM
    monkeypatch.setenv("PYTHONPATH", shim_pythonpath(shim))
    monkeypatch.setenv("SGLANG_ERNIE55_ECHO_DUMP_DIR", str(dump))
    if layout:
        monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
    return sh.Server(path, *FLAGS, *echo_checks.spec_flags(steps), *layout, log_name=name, timeout=900)


def _run(path, steps, name, tmp_path, monkeypatch, lengths, layout: tuple[str, ...] = ()):
    cfg = tiny_config()
    prompts = sh.make_prompts(cfg.vocab_size, cfg.bos_token_id, lengths=(*lengths, 1000), seed=1)[
        : len(lengths)
    ]
    dump = tmp_path / "dump"
    dump.mkdir()
    server = _serve(path, steps, name, dump, monkeypatch, layout)
    try:
        outs = [echo_checks.generate(server, p, NEW_TOKENS) for p in prompts]
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    assert "ECHO draft attached:" in log
    if layout:
        assert "'enable_dp_attention': True," in log and "DP1" in log, "the server did not run attention DP"
    assert "ERNIE-5.5 pool sizing: mode=hybrid-swa" in log  # window rows (target and draft) in the SWA pool
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference():
        s = sh.score(ref, prompts, outs, "cpu")
    print(f"\n[{name}, startup {server.startup_s:.0f}s] {s.summary()}")
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
    stats = echo_checks.check_draft_dumps(path, dump, cfg, "cpu", prompts, min_requests=len(prompts))
    metas = [o["meta"] for o in outs]
    assert all(m.get("spec_verify_ct", 0) >= 1 for m in metas), metas  # every request ran verify rounds
    return metas, stats


@pytest.mark.slow
def test_cpu_eagle_server_random_weights_rejects_and_matches_reference(tmp_path, monkeypatch):
    """Random tiny BF16 weights, 3 draft steps (4 verify rows per round): the draft almost never guesses, so
    every round rejects drafts and the next verify rewrites their slots, across positions 128 and 256."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    metas, _ = _run(path, 3, "cpu-echo-random-s3", tmp_path, monkeypatch, (19, 125, 250))
    correct = sum(m["spec_num_correct_drafts"] for m in metas)
    proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
    assert correct <= proposed // 2, metas  # mostly rejected: the rejection path ran in most rounds


@pytest.mark.slow
def test_cpu_eagle_server_echo_exact_accepts_every_draft(tmp_path, monkeypatch):
    """The ECHO-exact checkpoint (docs/echo.md section 7), 2 draft steps: every draft is accepted, so each
    round commits 3 tokens (rounds = ceil((new tokens - 1) / 3) after the prefill's token), and the tokens
    are still the reference's."""
    from sglang_ernie55.reference.echo import write_echo_exact_checkpoint

    path, _ = write_echo_exact_checkpoint(tmp_path / "exact", seed=0)
    metas, _ = _run(path, 2, "cpu-echo-exact-s2", tmp_path, monkeypatch, (19, 126, 254))
    assert all(m["spec_num_correct_drafts"] == m["spec_num_proposed_drafts"] for m in metas), metas
    assert all(m["spec_verify_ct"] == -(-(NEW_TOKENS - 1) // 3) for m in metas), metas


@pytest.mark.slow
def test_cpu_eagle_server_attn_dp2_matches_reference(tmp_path, monkeypatch):
    """ECHO (2 draft steps) under attention DP 2 (`--tp 2 --attn-dp-size 2`, attention TP 1), random weights: the
    requests go one at a time, each to one DP rank, so every draft-extend, draft decode and verify of the busy rank
    meets the other rank's IDLE forward in the FFN gathers (the shared last layer's too); the target streams the
    draft reads stay per rank. Greedy tokens = the reference's, and the draft path's dumps (one per DP rank)
    match the reference."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    # SGLang gives each DP rank chunked-prefill-size / attn-dp-size, a multiple of the 256 page: 512 (the later
    # flag of the two wins)
    layout = ("--tp", "2", "--attn-dp-size", "2", "--chunked-prefill-size", "512")
    _run(path, 2, "cpu-echo-random-s2-dp2", tmp_path, monkeypatch, (19, 125, 250), layout)
