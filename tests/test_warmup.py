"""The prefill warm-up's rules: its length within what the server admits, and which servers run it (a CPU
server runs it in tests/serving/test_server_cpu.py, a GPU server by default in test_user_path_gpu.py)."""

from __future__ import annotations

import pytest

from sglang_ernie55 import envs
from sglang_ernie55.warmup import (
    CHUNK_WHEN_UNCHUNKED,
    around_wait_and_warmup,
    prompt_len,
    sweep_lens,
    wanted,
)


@pytest.mark.parametrize(
    "chunk, max_input, want",
    [
        (8192, 10_000_000, 4 * 8192 + 2048 + 7),  # a chunk, three over cached prefixes, an odd remainder
        (256, 2042, 1095),
        (-1, 1_000_000, 4 * CHUNK_WHEN_UNCHUNKED + CHUNK_WHEN_UNCHUNKED // 4 + 7),  # chunked prefill off
        (None, 5000, 5000),  # a small pool or context admits less
    ],
)
def test_prompt_len(chunk, max_input, want):
    assert prompt_len(chunk, max_input) == want


@pytest.mark.parametrize("chunk, max_input", [(8192, 10_000_000), (256, 2042), (-1, 1_000_000), (None, 100)])
def test_sweep_lens_cover_each_bucket_in_both_classes(chunk, max_input):
    """Every power-of-two row-count bucket from 16 below the chunk gets a prompt whose length is a multiple of
    16 and one whose length is not (Triton's two specialisations), each within one chunk and what the server
    admits, shortest first; below 16, 1 to 4, 7 and 8."""
    c = chunk if chunk and chunk > 0 else CHUNK_WHEN_UNCHUNKED
    lens = sweep_lens(chunk, max_input)
    assert lens == sorted(set(lens)) and all(0 < n < c and n <= max_input for n in lens)
    p = 16
    while p <= c:
        near = [n for n in lens if p // 2 < n <= p]  # nearest power of two is p
        if p < c and p <= max_input:
            assert any(n % 16 == 0 for n in near) and any(n % 16 for n in near), (p, near)
        if p == c and c - 1 <= max_input:
            assert c - 1 in lens  # a last chunk just short of full: not a multiple of 16
        p *= 2
    if chunk == 8192:
        assert len(lens) == 25 and lens[:8] == [1, 2, 3, 4, 7, 8, 15, 16] and lens[-1] == 8191
    assert lens[:4] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "mode, device, pd, want",
    [
        ("auto", "cuda", "null", True),
        ("auto", "cpu", "null", False),
        ("1", "cpu", "null", True),
        ("0", "cuda", "null", False),
        ("auto", "cuda", "prefill", False),
        ("auto", "cuda", "decode", False),
    ],
)
def test_which_servers_warm_up(mode, device, pd, want):
    """(Another model on the same install: test_other_models_send_nothing.)"""
    assert wanted(mode, device, pd) is want


@pytest.mark.parametrize(
    "raw, want",
    [
        ("", None),
        ("64,8,1,4", (64, 8, True, True, 4)),
        (" 128,4,0,1 ", (128, 4, True, False, 1)),
        ("64,8,1", ValueError),
        ("64,8,1,3", ValueError),
        ("64,8,1,8", ValueError),
        ("48,8,1,2", ValueError),
        ("64,2,1,2", ValueError),
        ("64,8,2,2", ValueError),
        ("a,b,c,d", ValueError),
    ],
)
def test_indexer_extend_env(monkeypatch, raw, want):
    """SGLANG_ERNIE55_INDEXER_EXTEND: four integers within the legal sets, else an error naming the variable."""
    monkeypatch.setenv("SGLANG_ERNIE55_INDEXER_EXTEND", raw)
    if want is ValueError:
        with pytest.raises(ValueError, match="SGLANG_ERNIE55_INDEXER_EXTEND=.*rows in"):
            envs.indexer_extend_config()
    else:
        assert envs.indexer_extend_config() == want


def test_env_values(monkeypatch):
    monkeypatch.delenv("SGLANG_ERNIE55_PREFILL_WARMUP", raising=False)
    assert envs.prefill_warmup() == "auto"
    monkeypatch.setenv("SGLANG_ERNIE55_PREFILL_WARMUP", "sometimes")
    with pytest.raises(ValueError, match="auto, 1, 0"):
        envs.prefill_warmup()


def test_sglangs_warmup_runs_after_ours(monkeypatch):
    """The hook hands SGLang's warm-up thread a function that runs the prefill warm-up, then SGLang's own
    warm-up function, and returns its verdict; a failed prefill warm-up leaves SGLang's to decide."""
    import sglang_ernie55.warmup as w

    calls = []
    monkeypatch.setattr(w, "prefill_warmup", lambda sa: calls.append(("ours", sa)) or 1 / 0)

    def sglang_warmup(sa):
        calls.append(("sglang", sa))
        return True

    def wait_and_warmup(server_args, launch_callback=None, execute_warmup_func=None):
        return execute_warmup_func(server_args)

    assert (
        around_wait_and_warmup(wait_and_warmup, server_args="sa", execute_warmup_func=sglang_warmup) is True
    )
    assert around_wait_and_warmup(wait_and_warmup, "sa", None, sglang_warmup) is True
    assert calls == [("ours", "sa"), ("sglang", "sa")] * 2


def test_other_models_send_nothing(monkeypatch):
    """On an install that serves another model, the hook asks the config, not the server: no HTTP request."""
    import types

    import requests
    import sglang.srt.arg_groups.serving_hook  # noqa: F401
    import sglang.srt.runtime_context  # noqa: F401
    from sglang.srt.arg_groups import model_override_base

    import sglang_ernie55.warmup as w

    # (the modules the warm-up imports are imported above, before the patch: one imported under it would keep
    # the patched function for every later test)

    qwen = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]))
    monkeypatch.setattr(model_override_base, "model_config_of", lambda sa: qwen)
    monkeypatch.setattr(requests, "get", lambda *a, **k: pytest.fail("an HTTP request for another model"))
    monkeypatch.setenv("SGLANG_ERNIE55_PREFILL_WARMUP", "1")
    w.prefill_warmup(object())
