"""A start-up prefill, so the first prompt of a new length does not pay for Triton's compiles.

Prefill chunks launch kernels that decode never does (GEMM and fused-MoE tiles picked by row count, the
indexer's extend variant, top-k over long rows); Triton compiles them on first use. Before SGLang's own
warm-up request (the server reports healthy after it), an ERNIE-5.5 CUDA server sends one long prompt, then
short ones.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import envs
from .arch import is_ernie55

logger = logging.getLogger(__name__)

CHUNK_WHEN_UNCHUNKED = 8192  # the prompt's chunk when chunked prefill is off (-1)
LAUNCH_WAIT_S = 120  # as long as SGLang's warm-up waits for the server to answer


def prompt_len(chunk: int | None, max_input_len: int) -> int:
    """Four full chunks and a quarter, plus 7 tokens, within what the server admits: a chunk without a prefix
    and chunks over 1-3 cached ones (indexer chunks of other row counts at each width, as a long prompt has),
    and a last one of a token count that is not a multiple of 16 (Triton compiles such arguments apart)."""
    chunk = chunk if chunk and chunk > 0 else CHUNK_WHEN_UNCHUNKED
    return max(1, min(4 * chunk + chunk // 4 + 7, max_input_len))


def sweep_lens(chunk: int | None, max_input_len: int) -> list[int]:
    """Prompt lengths 2^i - 1 and 2^i from 1 up to the chunk (the long prompt's chunks are whole): SGLang's
    fused-MoE and block-FP8 GEMM runners take the tile config of the nearest tuned row count, and Triton
    compiles a kernel apart for a row count that is a multiple of 16 and one that is not (and for 1: the last
    token of a cached prompt); a shorter prompt of each power-of-two bucket, in each class, compiles them."""
    chunk = chunk if chunk and chunk > 0 else CHUNK_WHEN_UNCHUNKED
    lens: list[int] = []
    p = 1
    while p <= chunk:
        lens += [n for n in (p - 1, p) if 0 < n < chunk and n <= max_input_len and n not in lens]
        p *= 2
    return lens


def wanted(mode: str, device: str, disaggregation_mode: str) -> bool:
    """`SGLANG_ERNIE55_PREFILL_WARMUP` (`auto`: CUDA servers) outside PD disaggregation; the caller has
    already asked whether the model is ERNIE-5.5."""
    if mode == "0" or disaggregation_mode != "null":
        return False
    return mode == "1" or device == "cuda"


def around_wait_and_warmup(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND SGLang's `_wait_and_warmup` (the warm-up thread): its warm-up function runs after the prefill
    warm-up."""
    if len(args) >= 3:
        args = (*args[:2], _prefill_first(args[2]), *args[3:])
    else:
        if "execute_warmup_func" not in kwargs:
            from sglang.srt.entrypoints.http_server import _execute_server_warmup

            kwargs["execute_warmup_func"] = _execute_server_warmup
        kwargs["execute_warmup_func"] = _prefill_first(kwargs["execute_warmup_func"])
    return original(*args, **kwargs)


def _prefill_first(execute: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def run(server_args: Any) -> bool:
        try:
            prefill_warmup(server_args)
        except Exception as e:  # the server is as usable without it; SGLang's own warm-up still decides
            logger.warning("ERNIE-5.5: prefill warm-up skipped: %s: %s", type(e).__name__, e)
        return execute(server_args)

    return run


def prefill_warmup(server_args: Any) -> None:
    """Wait for the server to answer, then send each data-parallel rank one random prompt of `prompt_len`
    tokens, then one of each `sweep_lens` length in turn, two tokens out each, through `/generate`."""
    import requests
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.arg_groups.serving_hook import ssl_verify_of
    from sglang.srt.runtime_context import get_parallel, get_serving

    mode = envs.prefill_warmup()
    hf_config = model_config_of(server_args).hf_config
    if mode == "0" or not is_ernie55(hf_config):
        return
    url, verify = server_args.url(), ssl_verify_of(server_args)
    headers = {"Authorization": f"Bearer {get_serving().api_key}"} if get_serving().api_key else {}
    deadline = time.monotonic() + LAUNCH_WAIT_S
    while True:
        try:
            up = requests.get(url + "/model_info", timeout=5, headers=headers, verify=verify)
            if up.status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"/model_info did not answer in {LAUNCH_WAIT_S} s")
        time.sleep(1)
    info = requests.get(url + "/server_info", timeout=30, headers=headers, verify=verify).json()
    if not wanted(mode, info.get("device"), info.get("disaggregation_mode")):
        return
    chunk, max_input = info.get("chunked_prefill_size"), int(info["max_req_input_len"])
    n, sweep = prompt_len(chunk, max_input), sweep_lens(chunk, max_input)
    vocab = int(hf_config.vocab_size)
    ranks = max(1, int(get_parallel().num_dp_ranks))
    rng = random.Random(0)

    def one(ids: list[int]) -> None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        r = requests.post(url + "/generate", json=body, timeout=1800, headers=headers, verify=verify)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:200]}")

    logger.info(
        "ERNIE-5.5: prefill warm-up: %d prompt(s) of %d tokens, then %d of %s tokens (compiles the prefill "
        "kernels)",
        ranks,
        n,
        len(sweep) * ranks,
        f"{sweep[0]} .. {sweep[-1]}" if sweep else "no other",
    )
    start = time.perf_counter()
    with ThreadPoolExecutor(ranks) as pool:
        for length in [n, *sweep]:
            list(pool.map(one, [[rng.randrange(vocab) for _ in range(length)] for _ in range(ranks)]))
    logger.info("ERNIE-5.5: prefill warm-up done in %.1f s", time.perf_counter() - start)
