"""Baseline on one H200: a reduced-depth, full-width FP8 checkpoint (4 layers: dense+HCA, MLA-DSA, HCA,
HCA at the real widths, 512 experts, vocab 103424) served by SGLang with the `ernie55` backend on its
default compute (SGLANG_ERNIE55_ATTN_IMPL=auto: FlashMLA's sparse decode for HCA and MLA-DSA when
`flash_mla` imports, else the Triton kernels; the indexer, stores and compression on Triton), fp8_e4m3
KV, decode CUDA graphs on.

Measures decode throughput at batch 1 and 64 and TTFT of a 32K-token prompt (streaming /v1/completions,
chunked prefill 8192: the kernel path never materialises [queries, heads, keys]), writes them to
$SERVING_LOG_DIR/serving-results.jsonl and prints a table. The asserts check that the server ran the
expected compute (its log) and that the measurements are real (every request produced its tokens).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from tests.serving import server_harness as sh

pytestmark = [pytest.mark.gpu, pytest.mark.h200, pytest.mark.slow]

CTX = 32768 + 1024
DECODE_TOKENS = 128


def _stream(server: sh.Server, prompt: list[int], max_tokens: int) -> dict:
    """One streaming completion: time to first token, end time, tokens received."""
    body = dict(
        model=server.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        stream=True,
        return_token_ids=True,
    )
    t0 = time.perf_counter()
    first, n = None, 0
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            k = len(ch.get("token_ids") or []) or (1 if ch.get("text") else 0)
            if k and first is None:
                first = time.perf_counter() - t0
            n += k
    return {"ttft": first, "total": time.perf_counter() - t0, "tokens": n}


def _expected_impl() -> str:
    try:
        import flash_mla  # noqa: F401
    except Exception:
        return "triton"
    return "flashmla"


def test_full_width_fp8_baseline(tmp_path):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    t0 = time.time()
    path = make_checkpoint(tmp_path / "fw4", preset="full-width", layers=4, dtype="fp8", device="cuda")
    torch.cuda.empty_cache()
    make_s = time.time() - t0
    server = sh.Server(
        path,
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--context-length",
        str(CTX),
        "--max-running-requests",
        "64",
        "--cuda-graph-max-bs-decode",
        "64",
        "--chunked-prefill-size",
        "8192",
        "--mem-fraction-static",
        sh.mem_fraction("0.85"),
        "--disable-prefill-cuda-graph",
        "--sampling-backend",
        "pytorch",
        log_name="full-width-fp8",
        timeout=1200,
    )
    try:
        g = torch.Generator().manual_seed(0)
        vocab = 103424

        def prompt(n):
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            ids[0] = 1
            return ids

        sh.write_report(
            "full_width_fp8_progress",
            {"make_checkpoint_s": round(make_s, 1), "server_startup_s": round(server.startup_s, 1)},
        )
        _stream(server, prompt(64), 8)  # warm-up (Triton autotune / JIT)
        b1 = _stream(server, prompt(128), DECODE_TOKENS)
        sh.write_report("full_width_fp8_progress", {"bs1": b1})  # a run cut short still reports
        prompts = [prompt(128) for _ in range(64)]
        t = time.perf_counter()
        with ThreadPoolExecutor(64) as ex:
            b64 = list(ex.map(lambda p: _stream(server, p, DECODE_TOKENS), prompts))
        b64_wall = time.perf_counter() - t
        sh.write_report(
            "full_width_fp8_progress", {"bs64_wall_s": b64_wall, "bs64_tokens": sum(r["tokens"] for r in b64)}
        )
        long = _stream(server, prompt(32768), 1)
    finally:
        server.stop()
    impls = server.attention_impls()
    want = _expected_impl()
    assert impls == {"hca": want, "mla_dsa": want}, f"the backend ran {impls} (log {server.log_path})"
    res = {
        "attention": want,
        "layer_impl": server.layer_impl(),  # SGLANG_ERNIE55_LAYER_IMPL as the model logged it (auto: kernels)
        "make_checkpoint_s": round(make_s, 1),
        "server_startup_s": round(server.startup_s, 1),
        "decode_tok_s_bs1": round((b1["tokens"] - 1) / (b1["total"] - b1["ttft"]), 2),
        "decode_tok_s_bs64_total": round(sum(r["tokens"] for r in b64) / b64_wall, 2),
        "decode_tok_s_bs64_per_req": round(
            sum((r["tokens"] - 1) / (r["total"] - r["ttft"]) for r in b64) / len(b64), 2
        ),
        "ttft_32k_s": round(long["ttft"], 3),
    }
    sh.write_report("full_width_fp8_baseline", res)
    print("\n| metric | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in res.items()))
    assert b1["tokens"] == DECODE_TOKENS and all(r["tokens"] == DECODE_TOKENS for r in b64)
    assert long["tokens"] == 1 and long["ttft"] > 0
