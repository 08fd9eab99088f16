"""The real SGLang server on CPU (`--device cpu`): tiny BF16 checkpoint, fp32 activations, bf16 KV, over
SGLang's hybrid-SWA machinery (SWATokenToKVPoolAllocator + the SWA radix cache) with a small SWA pool;
greedy tokens equal the reference's (cached tensors rounded to bf16 as the pool stores them), on a
concurrent round, on a prefix hit whose cached prefix lost SWA rows to eviction, and after a request
aborted mid-decode."""

from __future__ import annotations

import re

import pytest
import torch

from tests.serving import server_harness as sh

FULL_TOKENS, SWA_RATIO = 8192, 0.125  # SWA pool 1024 tokens (4 pages): shorter than the longest request


@pytest.mark.slow
def test_cpu_server_matches_reference(tmp_path):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint
    from sglang_ernie55.configuration import tiny_config

    path = make_checkpoint(tmp_path / "bf16", dtype="bf16", seed=0)
    cfg = tiny_config()
    base = sh.make_prompts(cfg.vocab_size, cfg.bos_token_id, lengths=(19, 129, 257, 1300), seed=1)[:4]
    long = base[3]
    g = torch.Generator().manual_seed(2)
    victim = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (599,), generator=g).tolist()
    server = sh.Server(
        path,
        *sh.cpu_flags(
            context_length=2048,
            max_running_requests=8,
            max_total_tokens=FULL_TOKENS,
            swa_full_tokens_ratio=SWA_RATIO,
            chunked_prefill_size=256,
            disable_cuda_graph=True,
            disable_prefill_cuda_graph=True,
            sampling_backend="pytorch",
        ),
        log_name="cpu-server",
        env={"SGLANG_ERNIE55_PREFILL_WARMUP": "1"},  # `auto` runs it on CUDA servers only
    )
    try:
        first = server.complete_all(base, 8, workers=4)  # mixed batches, chunked prefill, SWA pressure
        # `long` alone, twice: the second request finds `long`'s pages (inserted by the first, with nothing in
        # between to evict their SWA rows) -- a hit on a prefix longer than the SWA pool. (One repeat right
        # after the concurrent round is not enough: whether the round's later allocations evict the tail's
        # SWA rows from the tree depends on which request finishes last, seen as a 0-token hit once.)
        warm = server.complete(long, 8)
        again = server.complete(long, 8)
        # an abort mid-decode, once the 600-token request has decoded 120 tokens (3 decode log lines):
        # its page 0 has left the window, so it holds fewer SWA rows than full slots
        n0 = server.log_path.read_text(errors="replace").count("Decode batch")
        aborted = server.generate_and_abort(
            victim, 1400, rid="ernie55-swa-abort", abort_when=lambda log: log.count("Decode batch") >= n0 + 3
        )
        after = server.complete(base[2], 8)  # the server still serves exactly after the abort
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert server.attention_impls() == {"hca": "torch", "mla_dsa": "torch"}, "the backend's choice log line"
    # the prefill warm-up ran before the server reported healthy: four chunks of 256, then 64 + 7 tokens, then
    # one prompt of 2^i - 1 and one of 2^i tokens per power of two below the chunk
    assert "prefill warm-up: 1 prompt(s) of 1095 tokens, then 15 of 1 .. 255 tokens" in log
    assert "prefill warm-up done" in log
    _, ref = sh.load_reference(path, "cpu")
    prompts, outs = base + [long, long, base[2]], first + [warm, again, after]
    with sh.kv_rounded_reference():
        s = sh.score(ref, prompts, outs, "cpu")
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert s.max_lp_err <= 0.02, s.summary()
    assert warm["tokens"] == again["tokens"] == first[3]["tokens"] and after["tokens"] == first[2]["tokens"]
    reason = aborted["meta_info"]["finish_reason"]
    done = aborted["meta_info"]["completion_tokens"]
    assert reason["type"] == "abort" and 0 < done < 1400, (reason, done)

    # SGLang ran the model as hybrid SWA with the pool our configurator sized from the given ratio ...
    swa = int(FULL_TOKENS * SWA_RATIO) // 256 * 256
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache hybrid_swa=True" in log
    assert f"ERNIE-5.5 KV pool: full_tokens={FULL_TOKENS} swa_tokens={swa} " in log
    assert f"swa_full_tokens_ratio={SWA_RATIO}" in log
    # ... the longest request holds more tokens than the SWA pool has rows: its out-of-window SWA slots were
    # freed and reused while it ran; and its repeat hit a cached prefix longer than the SWA pool, so older
    # pages of that prefix had lost their SWA rows (tombstones) -- and still gave the reference's tokens.
    assert len(long) + 8 > swa
    cached = [int(m) for m in re.findall(r"Prefill batch.*?#cached-token: (\d+)", log)]
    assert max(cached) > swa and max(cached) % 256 == 0, cached
    # while decoding, a running request pinned fewer SWA rows than full-pool slots (its out-of-window SWA
    # rows were freed by the scheduler or left to the tree as evictable)
    decode = [
        (int(f), int(w)) for f, w in re.findall(r"Decode batch.*?#full token: (\d+).*?#swa token: (\d+)", log)
    ]
    assert any(w < f for f, w in decode), decode
