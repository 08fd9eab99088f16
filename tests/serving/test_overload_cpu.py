"""Overload on one real SGLang server on CPU (tiny checkpoint): 20 concurrent streaming requests of mixed
lengths into a KV pool of 4 pages (SGLang queues them; its SGLANG_TEST_RETRACT switch retracts a running
request every few steps, as a full pool does, since real pressure needs long CPU decodes), 2 of them (10%)
closed mid-stream. Every other request completes with the greedy tokens it gets when served alone, the
pool's used tokens (full and SWA) return to their idle value, /health stays OK and the log has no error.
The GPU version (256 requests, real pool pressure, ECHO off and on) is test_overload_gpu.py."""

from __future__ import annotations

import pytest

from tests.serving import overload_harness as oh
from tests.serving import server_harness as sh

FULL_TOKENS = 1024  # 4 pages of 256 tokens (the SWA pool as many): a few requests fill it
FLAGS = sh.cpu_flags(
    context_length=2048, max_running_requests=8, max_total_tokens=FULL_TOKENS, swa_full_tokens_ratio="1.0"
)
LENGTHS = (12, 300, 90, 200, 250, 40, 310, 257, 150, 230, 66, 180, 240, 100, 290, 33, 170, 128, 260, 60)
ABORTED = {3, 13}  # closed after their first chunks
# the closed ones ask for as many tokens as the pool holds: minutes of CPU decode unless the server aborts them
MAX_TOKENS = [FULL_TOKENS - n - 24 if i in ABORTED else (4, 8, 12, 6)[i % 4] for i, n in enumerate(LENGTHS)]
RETRACT_EVERY = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "4"}  # forward steps


@pytest.mark.slow
def test_cpu_server_under_overload(tmp_path):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    prompts = oh.make_prompts(cfg.vocab_size, cfg.bos_token_id, LENGTHS, seed=3)
    pages = sum(-(-(len(p) + n) // 256) for p, n in zip(prompts, MAX_TOKENS))
    assert pages > 4 * FULL_TOKENS // 256, "the requests must not fit at once"
    server = sh.Server(path, *FLAGS, log_name="overload-cpu", env=RETRACT_EVERY)
    try:
        result = oh.run_overload(server, prompts, MAX_TOKENS, ABORTED)
    finally:
        server.stop()
    print(f"\noverload (CPU): {result}")
    sh.write_report("overload_cpu", result)
    oh.check(result, ABORTED)
    assert result["retractions"] > 0, result
    assert result["drain_s"] < 60, f"the closed requests kept decoding: {result}"
