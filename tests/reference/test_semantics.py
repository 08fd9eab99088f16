"""Model-level properties of the reference that a wrong mask, cache or weight link would break."""

from __future__ import annotations

import torch

from sglang_ernie55.configuration import tiny_config
from sglang_ernie55.reference import build_reference


def _ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_causal():
    m = build_reference(tiny_config(), seed=2)
    a = _ids(200, 0)
    b = a.clone()
    b[150:] = _ids(50, 1)
    la, lb = m(a).logits, m(b).logits
    torch.testing.assert_close(la[:150], lb[:150], rtol=0, atol=1e-5)
    assert (la[150:] - lb[150:]).abs().amax() > 1e-2


def test_hca_sees_old_tokens_only_through_complete_compressed_blocks():
    """One HCA layer (dense FFN): a token at position 130 reaches queries 130..257 through the window and
    queries >= 255 (block 1 complete) through its compressed entry; the window-only (ECHO) mode loses
    the second path, so queries >= 258 stop depending on it."""
    m = build_reference(
        tiny_config(num_hidden_layers=1, layer_types=["hca"], num_nextn_predict_layers=0), seed=3
    )
    a = _ids(400, 4)
    b = a.clone()
    b[130] = (a[130] + 1) % 509 + 3
    diff = (m(a).logits - m(b).logits).abs().amax(-1)
    assert diff[:130].max() < 1e-5
    assert diff[130:258].min() > 1e-4 and diff[258:].min() > 1e-6
    layer = m.model.layers[0]
    pos = torch.arange(400)

    def attn(ids, window_only):
        y = m.model.embed_tokens.weight[ids].float()
        return layer.self_attn(y, pos, window_only=window_only)

    w = (attn(a, True) - attn(b, True)).abs().amax(-1)
    assert w[258:].max() < 1e-6 and w[130:258].min() > 1e-6


def test_dsa_topk_selects_and_equals_dense_causal_when_large():
    base = dict(num_hidden_layers=2, layer_types=["mla_dsa", "mla_dsa"], num_nextn_predict_layers=0)
    sparse = build_reference(tiny_config(index_topk=16, **base), seed=5)
    dense = build_reference(tiny_config(index_topk=4096, **base), seed=5)
    ids = _ids(80, 6)
    ls, ld = sparse(ids).logits, dense(ids).logits
    torch.testing.assert_close(ls[:16], ld[:16], rtol=0, atol=1e-5)  # t < topk: all keys kept
    assert (ls[40:] - ld[40:]).abs().amax() > 1e-3


def test_echo_runs_the_last_layer_itself():
    m = build_reference(tiny_config(), seed=7)
    ids = _ids(140, 8)
    streams = m(ids[:-1]).streams
    before = m.echo_forward(streams, ids[1:]).logits
    m.model.layers[0].self_attn.wo_b.weight.data.mul_(0.5)  # not the ECHO layer: no effect given the streams
    torch.testing.assert_close(m.echo_forward(streams, ids[1:]).logits, before, rtol=0, atol=0)
    m.model.layers[-1].self_attn.wo_b.weight.data.mul_(0.5)  # the last layer is the ECHO layer
    assert (m.echo_forward(streams, ids[1:]).logits - before).abs().amax() > 1e-3
    assert not any(n.startswith("echo.layer") for n, _ in m.named_parameters())  # no copy of the layer
