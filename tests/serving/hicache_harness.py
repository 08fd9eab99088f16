"""The HiCache scenario of tests/serving/test_hicache_{cpu,gpu}.py on a real server.

A device pool of 2048 tokens (8 pages; SWA 6 in hybrid mode) and `--hicache-ratio 2`: prompt A (600 tokens)
is served (a miss), repeated (a device hit of its two whole pages), pushed out of the device pool by three
700-token prompts (each inserts and backs up two pages; the third needs A's pages), then repeated again: a
host hit, loaded back. The host hit and the device hit are the same forward over the same bytes, so their
tokens and logprobs must be identical.
"""

from __future__ import annotations

import re

import requests
import torch

from tests.serving import server_harness as sh

POOL_TOKENS = 2048
FLAGS = dict(
    context_length=2048,
    max_total_tokens=POOL_TOKENS,
    chunked_prefill_size=512,
    sampling_backend="pytorch",
    enable_hierarchical_cache=True,
    hicache_ratio=2,
    enable_metrics=True,
)
# hybrid SWA: 6 of the 8 pages, so that the host's window pages (2 x 6) outlast the fill (A + 3 x 2 pages)
SWA_RATIO = 0.75
LENGTHS = (600, 700, 700, 700)
HIT = 512  # A's two whole pages
NEW_TOKENS = 8


def prompts(cfg) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


def generate(server: sh.Server, ids: list[int], n: int = NEW_TOKENS) -> dict:
    """Greedy /generate: tokens, their logprobs and the prompt tokens served from each cache tier."""
    body = dict(
        input_ids=ids,
        sampling_params=dict(max_new_tokens=n, temperature=0, ignore_eos=True),
        return_logprob=True,
    )
    r = requests.post(server.url + "/generate", json=body, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"/generate {r.status_code}: {r.text[:500]}\n{server.tail()}")
    meta = r.json()["meta_info"]
    return {
        "tokens": r.json()["output_ids"],
        "logprobs": [lp for lp, _tok, _text in meta["output_token_logprobs"]],
        "cached": meta.get("cached_tokens_details") or {"device": 0, "host": 0},
    }


def metric(text: str, mode: str) -> float:
    """`sglang:prefill_effective_tokens_total{mode=...}` of a /metrics page (summed over label sets)."""
    rx = rf'sglang:prefill_effective_tokens_total{{[^}}]*mode="{mode}"[^}}]*}} ([0-9.e+]+)'
    return sum(float(x) for x in re.findall(rx, text))


def run(server: sh.Server, cfg) -> dict:
    a, *fillers = prompts(cfg)
    miss = generate(server, a)
    device = generate(server, a)
    filled = [generate(server, p) for p in fillers]
    host = generate(server, a)
    page = requests.get(server.url + "/metrics", timeout=60).text
    totals = {m: metric(page, m) for m in ("host_hit", "device_hit", "input")}
    return dict(prompts=[a, a, a, *fillers], outs=[miss, device, host, *filled], totals=totals)


def hits(result: dict) -> dict:
    """What the server reported: per request of A and the server's totals, with the host hit rate."""
    miss, device, host = result["outs"][:3]
    t = result["totals"]
    return {
        "miss": miss["cached"],
        "device_hit": device["cached"],
        "host_hit": host["cached"],
        "totals": t,
        "host_hit_rate": t["host_hit"] / max(sum(t.values()), 1),
    }


def check_host_hit(result: dict, log: str, regions: str) -> None:
    """The host hit served A's pages from the host and gave the device hit's tokens and logprobs."""
    miss, device, host = result["outs"][:3]
    assert f"ERNIE-5.5 HiCache: host pools {regions}" in log, regions
    assert "hicache_attached=True" in log
    assert miss["cached"]["device"] + miss["cached"]["host"] == 0, miss["cached"]
    assert device["cached"] == {"device": HIT, "host": 0}, device["cached"]
    assert host["cached"] == {"device": 0, "host": HIT}, host["cached"]
    assert result["totals"]["host_hit"] == HIT and result["totals"]["device_hit"] == HIT, result["totals"]
    assert host["tokens"] == device["tokens"] == miss["tokens"]
    assert host["logprobs"] == device["logprobs"]  # the same forward over the same bytes
