"""Overload on a real SGLang server on a GPU (tiny checkpoint): 256 concurrent streaming requests of 1 to 8K
prompt tokens into a KV pool that holds a fraction of them (SGLang queues and retracts), 26 of them (10%)
closed mid-stream, with ECHO off and on. Every other request completes with the greedy tokens it gets when
served alone (`--enable-deterministic-inference`: batch-invariant greedy output), the pool's used tokens
return to their idle value, /health stays OK and the log has no error. The CPU version is
test_overload_cpu.py. Run: `python3 -m pytest -m gpu tests/serving/test_overload_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from tests.serving import overload_harness as oh
from tests.serving import server_harness as sh

pytestmark = [pytest.mark.gpu]

N_REQUESTS, N_ABORTED = 256, 26
FULL_TOKENS = 65536  # the workload's prompts and outputs total ~4.8x this
FLAGS = (
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "bfloat16",
    "--context-length",
    "16384",
    "--max-running-requests",
    "128",
    "--max-total-tokens",
    str(FULL_TOKENS),
    "--enable-deterministic-inference",
    "--mem-fraction-static",
    sh.mem_fraction("0.5"),
)
ECHO = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2")


def _workload(vocab: int, bos: int):
    g = torch.Generator().manual_seed(5)
    # prompt lengths log-uniform over 1..8192, outputs 16..128 tokens; the aborted ones ask for 2048
    lengths = (
        torch.exp(torch.rand(N_REQUESTS, generator=g) * torch.log(torch.tensor(8192.0))).long().clamp(1, 8192)
    )
    aborted = set(torch.randperm(N_REQUESTS, generator=g)[:N_ABORTED].tolist())
    outputs = torch.randint(16, 129, (N_REQUESTS,), generator=g).tolist()
    max_tokens = [2048 if i in aborted else outputs[i] for i in range(N_REQUESTS)]
    prompts = oh.make_prompts(vocab, bos, [max(int(n), 1) for n in lengths], seed=6)
    return prompts, max_tokens, aborted


@pytest.mark.parametrize("echo", [False, True], ids=["echo-off", "echo-on"])
def test_gpu_server_under_overload(echo, tmp_path):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    prompts, max_tokens, aborted = _workload(cfg.vocab_size, cfg.bos_token_id)
    assert sum(len(p) + n for p, n in zip(prompts, max_tokens)) > 2 * FULL_TOKENS
    server = sh.Server(path, *FLAGS, *(ECHO if echo else ()), log_name=f"overload-gpu-echo-{echo}")
    try:
        result = oh.run_overload(server, prompts, max_tokens, aborted)
    finally:
        server.stop()
    print(f"\noverload (GPU, ECHO {'on' if echo else 'off'}): {result}")
    sh.write_report(f"overload_gpu_echo_{'on' if echo else 'off'}", result)
    oh.check(result, aborted)
