"""A prompt served again from the prefix cache, on one real SGLang server on CPU (tiny checkpoint): SGLang
0.5.23 recomputes at least the prompt's last token however much of it is cached
(`Req._compute_max_prefix_len`: at most input length - 1 tokens match, page-aligned), so the `ernie55` backend
never receives a request with no new token from it (docs/serving-design.md 6.3); the cached answer equals the
uncached one, with `max_new_tokens` 0 too."""

from __future__ import annotations

import re

import pytest
import requests
import torch

from tests.serving import server_harness as sh

PAGE = 256
# SGLang 0.5.23 admits a prefix hit only when the free + evictable SWA rows, the hit's page pinned, exceed its
# estimate for the resume (`estimate_swa_kv_tokens`: 2 pages here); the demo's 3-page SWA pool (0.1 of 8192)
# never does, and the request waits in the queue. 0.125 of 8192 is 4 pages.
FLAGS = sh.cpu_flags(context_length=2048, swa_full_tokens_ratio=0.125)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("prefix-hit") / "bf16", dtype="bf16", seed=0)
    srv = sh.Server(path, *FLAGS, log_name="prefix-hit")
    yield srv
    srv.stop()


def _generate(server, ids: list[int], max_new: int, **extra) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        **extra,
    }
    r = requests.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, f"{r.status_code} {r.text[:400]}\n{server.tail()}"
    out = r.json()
    meta = out["meta_info"]
    return {"tokens": out["output_ids"], "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"]}


@pytest.mark.slow
def test_a_cached_prompt_still_extends_and_answers_as_uncached(server):
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    g = torch.Generator().manual_seed(3)
    prompt = [cfg.bos_token_id] + torch.randint(3, cfg.vocab_size, (PAGE,), generator=g).tolist()  # 257
    rows = []

    def run(name, ids, max_new, **extra):
        out = _generate(server, ids, max_new, **extra)
        rows.append((name, out["prompt"], out["cached"], out["prompt"] - out["cached"], out["tokens"]))
        return out

    miss = run("first (nothing cached)", prompt, 4)
    hit = run("again (its first page cached)", prompt, 4)
    empty = run("again, max_new_tokens 0", prompt, 0)
    after = run("again after the 0-token answer", prompt, 4)
    page = run("its first page alone (cached whole)", prompt[:PAGE], 4)
    logprobs = run("again, logprobs from position 0", prompt, 4, return_logprob=True, logprob_start_len=0)
    table = "\n".join(f"{n:38} prompt {p:4} cached {c:4} new {e:4} tokens {t}" for n, p, c, e, t in rows)
    print("\n" + table)
    sh.write_report("prefix_hit", {"rows": rows})

    assert miss["cached"] == 0
    # the whole first page hits; the 257th token is the one new token of the extend
    assert hit["cached"] == empty["cached"] == after["cached"] == PAGE, table
    assert hit["tokens"] == after["tokens"] == logprobs["tokens"] == miss["tokens"], table
    assert empty["tokens"] == [], table
    # a prompt that is one whole cached page: at most 255 tokens may match, page-aligned 0: all recomputed
    assert page["cached"] == 0, table
    # logprobs of every prompt position need every position computed: nothing matches
    assert logprobs["cached"] == 0, table
    assert all(e >= 1 for *_, e, _ in rows), table
    log = server.log_path.read_text(errors="replace")
    new = [int(m) for m in re.findall(r"Prefill batch.*?#new-token: (\d+)", log)]
    assert new and min(new) >= 1, new
    assert "Traceback" not in log, server.tail()
