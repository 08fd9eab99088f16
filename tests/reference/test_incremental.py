"""Incremental extend/decode with explicit caches gives the full forward's logits, across the window
(128), compression-block (128), page (256) and index_topk (64) boundaries, for any chunking."""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import tiny_config
from sglang_ernie55.reference import build_reference


@pytest.fixture(scope="module")
def model():
    return build_reference(tiny_config(), seed=1)


def _chunks(total: int, plan: list[int]) -> list[int]:
    out, left = [], total
    for c in plan:
        if left <= 0:
            break
        out.append(min(c, left))
        left -= out[-1]
    while left > 0:  # decode the rest one token at a time
        out.append(1)
        left -= 1
    return out


@pytest.mark.parametrize(
    "length, plan",
    [
        (1, []),
        (19, [7]),
        (97, [64, 30]),
        (127, [126]),
        (128, [127]),
        (129, [127]),
        (255, [128, 126]),
        (257, [1, 254]),
        (300, [100, 28, 1, 1, 127, 40]),
        (520, [256, 255, 3]),
    ],
)
def test_incremental_matches_full(model, length, plan):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, model.config.vocab_size, (length,), generator=g)
    full = model(ids).logits
    cache, parts, s = model.new_cache(), [], 0
    for c in _chunks(length, plan):
        parts.append(model.step(ids[s : s + c], cache).logits)
        s += c
    inc = torch.cat(parts)
    assert cache.next_pos == length
    torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-4)
    # the HCA ring keeps exactly the window; compressed entries = complete blocks
    hca = cache.layers[0]
    assert hca.kv.shape[0] == min(length, model.config.window_size)
    assert (0 if hca.cmp is None else hca.cmp.shape[0]) == length // model.config.compress_ratio


@pytest.mark.parametrize("length", [130, 300])
def test_echo_incremental_matches_full(model, length):
    g = torch.Generator().manual_seed(length + 7)
    ids = torch.randint(3, model.config.vocab_size, (length + 1,), generator=g)
    streams = model(ids[:-1]).streams
    full = model.echo_forward(streams, ids[1:])
    cache, parts, s = model.new_echo_cache(), [], 0
    for c in _chunks(length, [60, 70, 1]):
        parts.append(
            model.echo_forward(streams[s : s + c], ids[s + 1 : s + c + 1], cache=cache, start_pos=s).logits
        )
        s += c
    torch.testing.assert_close(torch.cat(parts), full.logits, rtol=1e-4, atol=1e-4)
