"""The real SGLang server on CPU (`--device cpu`): tiny BF16 checkpoint, fp32 activations, bf16 KV;
greedy tokens equal the reference's (cached tensors rounded to bf16 as the pool stores them); a repeated
request (radix-cache page hits) answers the same."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import server_harness as sh  # noqa: E402


@pytest.mark.slow
def test_cpu_server_matches_reference(tmp_path):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    cfg = tiny_config()
    prompts = sh.make_prompts(cfg.vocab_size, cfg.bos_token_id, lengths=(19, 129, 257, 1000), seed=1)
    server = sh.Server(path, "--device", "cpu", "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
                       "--context-length", "2048", "--max-running-requests", "8", "--max-total-tokens", "8192",
                       "--chunked-prefill-size", "256", "--disable-cuda-graph", "--disable-prefill-cuda-graph",
                       "--sampling-backend", "pytorch", log_name="cpu-server")  # fmt: skip
    try:
        first = server.complete_all(prompts, 8, workers=4)
        again = server.complete_all(prompts, 8, workers=4)
    finally:
        server.stop()
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference():
        s = sh.score(ref, prompts, first, "cpu")
    assert [o["tokens"] for o in again] == [o["tokens"] for o in first]
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
