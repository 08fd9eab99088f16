"""Multi-rank layouts through SGLang's real server, on CPU (two or four scheduler ranks, gloo collectives): the
tiny BF16 checkpoint at fp32 activations with bf16 KV. Greedy tokens must equal the single-process reference's (the
KV-rounded oracle of test_server_cpu.py) and logprobs stay within 0.02.

- `--tp 2`: the attention layers' head / HCA output-group sharding (`wq_b`, `wo_a`, `wo_b`, `q_b_proj`,
  `kv_b_proj`, `o_proj`, the sink), the vocab-parallel embedding and LM head, the latent MoE's expert sharding and
  the sum of its partial outputs over the ranks (FusedMoE returns each rank's partial, reduce_results=False).
- `--tp 2 --attn-dp-size 2` (attention TP 1): each DP rank schedules its own requests over its own KV pools, runs
  attention on whole heads and embeds its own tokens; the FFNs (dense and MoE, sharded over the TP group) run on
  both ranks' rows, gathered before them and scattered back after them; a rank without requests runs SGLang's
  IDLE batches; the logits processor gathers the rows for the vocab-parallel LM head.
- `--tp 4 --attn-dp-size 2` (attention TP 2, four ranks): heads, output groups, the sink and the embedding shard
  over each DP rank's attn_tp pair, the row-parallel attention outputs reduce over that pair only, SGLang pads each
  rank's batch to an even row count (padded decode requests, padded extend rows the backend drops) and the FFN
  gather takes one copy of each pair's rows (the replicate contract: a reduce-scatter over attn_tp, then an
  all-gather over TP, or attn_tp rank 0's rows into an all-reduce).
- `--enable-dp-lm-head` at attention TP 1 and 2: each DP rank's rows through a head over its attn_tp group, the
  logits all-gathered over that group, no DP gather.
- `--tp 2 --ep 2 --moe-a2a-backend none`: SGLang's standard EP dispatch. Each rank owns 8 of the 16 routed experts
  (FusedMoE's loader keeps the rank's experts of the checkpoint, the dispatcher maps global ids to local ones and
  drops the others), latent_down / latent_up / the shared expert run on every rank over every token, and the
  routed partials plus the shared expert's TP partial are summed in one all-reduce over the TP group.

- `--tp 2 --attn-cp-size 2 --enable-prefill-cp --cp-strategy interleave` (attention TP 1): SGLang splits each
  prefill batch over the two CP ranks (token r, r + 2, ... on rank r) and gathers the hidden states before the
  LM head; each layer gathers every rank's keys (HCA window rows and compressor rows, MLA latents and indexer
  keys) before storing and compressing them and attends its own queries; the FFNs run on both ranks' rows;
  decode runs whole on both ranks.

`cpu_tp_shim/` works around SGLang 0.5.23's CPU limits outside the model (its docstring lists them); four ranks
share two cores (SGLANG_CPU_OMP_THREADS_BIND 0|1|0|1). Attention CP beyond these layouts, attention DP with EP,
and the MoE all-to-all backends are refused when the model is built (docs/serving-design.md section 8).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.serving import server_harness as sh
from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

SHIM = Path(__file__).parent / "cpu_tp_shim"


def _serve_and_score(tmp_path, *layout: str, log_name: str, chunk: int = 256, ranks: int = 2):
    """Serve the tiny BF16 checkpoint with `layout` on `ranks` CPU ranks (its --tp), 8 greedy tokens for five
    prompts; returns (score against the KV-rounded reference, server log)."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    cfg = tiny_config()
    prompts = sh.make_prompts(cfg.vocab_size, cfg.bos_token_id, lengths=(19, 129, 300, 1100), seed=1)
    env = {
        "PYTHONPATH": shim_pythonpath(SHIM),
        # one core per rank, round robin over the host's cores (SGLang binds CPU ranks to NUMA nodes otherwise,
        # and this host has one): 0|1 for two ranks, 0|1|0|1 for four on two cores
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % (os.cpu_count() or 1)) for r in range(ranks)),
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
    assert f"TP{ranks - 1}" in log, f"the server did not run {ranks} ranks"
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


@pytest.mark.slow
def test_tp4_attn_dp2_cpu_server_matches_reference(tmp_path):
    # attention TP 2 under attention DP 2, four ranks: heads / output groups / sink / embedding over each attn_tp
    # pair, the FFN gather takes one copy of each pair's rows (SGLang pads a rank's rows to a multiple of 2)
    s, log = _serve_and_score(
        tmp_path, "--tp", "4", "--attn-dp-size", "2", log_name="cpu-tp4-dp2", chunk=512, ranks=4
    )
    assert "'enable_dp_attention': True," in log and "DP1 TP3" in log, "the server did not run attention DP"
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4], ids=["attn-tp1", "attn-tp2"])
def test_attn_dp2_dp_lm_head_cpu_server_matches_reference(tmp_path, tp):
    # --enable-dp-lm-head: each DP rank's own rows through a head over its attn_tp group (the whole vocabulary at
    # attention TP 1; at attention TP 2 a vocab half per rank, the logits all-gathered over the pair), no DP gather
    s, log = _serve_and_score(
        tmp_path,
        *("--tp", str(tp), "--attn-dp-size", "2", "--enable-dp-lm-head"),
        log_name=f"cpu-tp{tp}-dp2-dp-lm-head",
        chunk=512,
        ranks=tp,
    )
    assert "'enable_dp_lm_head': True," in log and "DP1" in log, "the server did not run a DP LM head"
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()


@pytest.mark.slow
def test_tp2_attn_cp2_cpu_server_matches_reference(tmp_path):
    s, log = _serve_and_score(
        tmp_path,
        "--tp",
        "2",
        "--attn-cp-size",
        "2",
        "--enable-prefill-cp",
        "--cp-strategy",
        "interleave",
        log_name="cpu-tp2-cp2",
    )
    assert "ATTN_CP1" in log, "the server did not run a second attention-CP rank"
    assert "prefill CP splits this extend" in log, "no prefill batch was split over the CP ranks"
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
