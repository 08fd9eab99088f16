"""Multi-rank layouts through SGLang's real server, on CPU (two scheduler ranks, gloo collectives): the tiny
BF16 checkpoint at fp32 activations with bf16 KV. Greedy tokens must equal the single-process reference's (the
KV-rounded oracle of test_server_cpu.py) and logprobs stay within 0.02.

- `--tp 2`: the attention layers' head / HCA output-group sharding (`wq_b`, `wo_a`, `wo_b`, `q_b_proj`,
  `kv_b_proj`, `o_proj`, the sink), the vocab-parallel embedding and LM head, the latent MoE's expert sharding and
  the sum of its partial outputs over the ranks (FusedMoE returns each rank's partial, reduce_results=False).
- `--tp 2 --attn-dp-size 2` (attention TP 1): each DP rank schedules its own requests over its own KV pools, runs
  attention on whole heads and embeds its own tokens; the FFNs (dense and MoE, sharded over the TP group) run on
  both ranks' rows, gathered before them and scattered back after them; a rank without requests runs SGLang's
  IDLE batches; the logits processor gathers the rows for the vocab-parallel LM head.
- `--tp 2 --ep 2 --moe-a2a-backend none`: SGLang's standard EP dispatch. Each rank owns 8 of the 16 routed experts
  (FusedMoE's loader keeps the rank's experts of the checkpoint, the dispatcher maps global ids to local ones and
  drops the others), latent_down / latent_up / the shared expert run on every rank over every token, and the
  routed partials plus the shared expert's TP partial are summed in one all-reduce over the TP group.

`cpu_tp_shim/` works around SGLang 0.5.23's CPU limits outside the model (its docstring lists them). Attention CP,
attention DP beyond these layouts and the MoE all-to-all backends are refused when the model is built
(docs/serving-design.md section 8).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.serving import server_harness as sh

SHIM = Path(__file__).parent / "cpu_tp_shim"


def _serve_and_score(tmp_path, *layout: str, log_name: str, chunk: int = 256):
    """Serve the tiny BF16 checkpoint with `layout` on two CPU ranks, 8 greedy tokens for five prompts; returns
    (score against the KV-rounded reference, server log)."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    cfg = tiny_config()
    prompts = sh.make_prompts(cfg.vocab_size, cfg.bos_token_id, lengths=(19, 129, 300, 1100), seed=1)
    env = {
        "PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
        # one core per rank (SGLang binds CPU ranks to NUMA nodes otherwise, and this host has one)
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
    }
    server = sh.Server(
        str(path),
        *layout,
        *sh.cpu_flags(
            context_length=2048,
            max_running_requests=8,
            chunked_prefill_size=chunk,
            disable_cuda_graph=True,
            disable_prefill_cuda_graph=True,
            sampling_backend="pytorch",
        ),
        log_name=log_name,
        env=env,
        timeout=900,
    )
    try:
        outs = server.complete_all(prompts, 8, workers=4)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "TP1" in log, "the server did not run a second rank"
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference():
        s = sh.score(ref, prompts, outs, "cpu")
    print(f"\n[{log_name}, startup {server.startup_s:.0f}s] {s.summary()}")
    return s, log


@pytest.mark.slow
def test_tp2_cpu_server_matches_reference(tmp_path):
    s, _ = _serve_and_score(tmp_path, "--tp", "2", log_name="cpu-tp2")
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()


@pytest.mark.slow
def test_tp2_ep2_cpu_server_matches_reference(tmp_path):
    s, log = _serve_and_score(
        tmp_path, "--tp", "2", "--ep", "2", "--moe-a2a-backend", "none", log_name="cpu-tp2-ep2"
    )
    assert "'ep_size': 2," in log, "the server did not run expert parallelism"
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()


@pytest.mark.slow
def test_tp2_attn_dp2_cpu_server_matches_reference(tmp_path):
    # SGLang gives each DP rank chunked-prefill-size / attn-dp-size, which must stay a multiple of the 256 page
    s, log = _serve_and_score(tmp_path, "--tp", "2", "--attn-dp-size", "2", log_name="cpu-tp2-dp2", chunk=512)
    assert "'enable_dp_attention': True," in log and "DP1" in log, "the server did not run attention DP"
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
