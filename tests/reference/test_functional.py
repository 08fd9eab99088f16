"""Each reference building block against an independent formulation (loops, complex numbers, brute force)."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_ernie55.reference import functional as Fn
from sglang_ernie55.reference.mhc import hc_post, hc_pre, sinkhorn
from sglang_ernie55.reference.rope import apply_rope_half, apply_rope_interleaved, yarn_inv_freq

YARN = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}


def test_rope_interleaved_is_complex_rotation_and_inverts():
    torch.manual_seed(0)
    inv = yarn_inv_freq(64, 160000.0, YARN)
    x, pos = torch.randn(19, 4, 64), torch.randint(0, 1_000_000, (19,))
    ang = pos[:, None].double() * inv[None].double()
    z = (
        torch.view_as_complex(x.double().view(19, 4, 32, 2).contiguous())
        * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    )
    want = torch.view_as_real(z).flatten(-2).float()
    got = apply_rope_interleaved(x, pos, inv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(apply_rope_interleaved(got, pos, inv, inverse=True), x, rtol=1e-5, atol=1e-4)


def test_rope_half_pairs_i_with_i_plus_half():
    torch.manual_seed(1)
    inv = yarn_inv_freq(64, 160000.0, YARN)
    x, pos = torch.randn(5, 64), torch.randint(0, 5000, (5,))
    got = apply_rope_half(x, pos, inv)
    perm = torch.stack([torch.arange(32), torch.arange(32) + 32], -1).flatten()  # (i, i+32) adjacent
    want = apply_rope_interleaved(x[:, perm], pos, inv)[:, torch.argsort(perm)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_yarn_blend_matches_deepseek_ramp():
    base, dim = 160000.0, 64
    inv = yarn_inv_freq(dim, base, YARN)
    plain = 1.0 / base ** (torch.arange(0, dim, 2).double() / dim)

    def corr(rot):
        return dim * math.log(65536 / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = plain[i] / 16 * ramp + plain[i] * (1 - ramp)
        assert math.isclose(inv[i].item(), want, rel_tol=1e-5), i
    assert inv[0] == pytest.approx(plain[0].item()) and inv[-1] == pytest.approx(plain[-1].item() / 16)


def test_sink_attention_matches_per_query_loop():
    torch.manual_seed(2)
    T, S, h, D = 7, 11, 3, 16
    q, kv, sink = torch.randn(T, h, D), torch.randn(S, D), torch.randn(h)
    mask = torch.rand(T, S) > 0.4
    mask[:, 0] = True
    got = Fn.sink_attention(q, kv, mask, sink, 0.3)
    for t in range(T):
        for hh in range(h):
            idx = mask[t].nonzero().flatten()
            e = torch.exp((kv[idx] @ q[t, hh]) * 0.3)
            want = (e[:, None] * kv[idx]).sum(0) / (e.sum() + torch.exp(sink[hh]))
            torch.testing.assert_close(got[t, hh], want, rtol=1e-5, atol=1e-6)


def test_hca_compress_block_formula():
    torch.manual_seed(3)
    r, D = 8, 16
    c, s, ape, w = torch.randn(r, D), torch.randn(r, D), torch.randn(r, D), torch.rand(D) + 0.5
    inv = yarn_inv_freq(8, 10000.0, None)
    got = Fn.hca_compress_block(c, s, ape, w, 1e-6, 3, inv, 8)
    pooled = torch.zeros(D)
    for d in range(D):  # per-channel softmax over the block's tokens
        e = torch.exp(s[:, d] + ape[:, d])
        pooled[d] = (e * c[:, d]).sum() / e.sum()
    normed = pooled / torch.sqrt(pooled.pow(2).mean() + 1e-6) * w
    normed[-8:] = apply_rope_interleaved(normed[None, -8:], torch.tensor([3 * r]), inv)[0]
    torch.testing.assert_close(got, normed, rtol=1e-5, atol=1e-5)


def test_hca_visible_masks():
    q = torch.tensor([0, 126, 127, 128, 255, 256, 300])
    raw, cmp = Fn.hca_visible_mask(q, torch.arange(301), 3, window=128, ratio=128)
    for i, p in enumerate(q.tolist()):
        assert raw[i].nonzero().flatten().tolist() == list(range(max(0, p - 127), p + 1))
        assert cmp[i].sum().item() == (p + 1) // 128


def test_indexer_topk_ties_prefer_earlier_and_keep_all_when_few():
    scores = torch.zeros(1, 6)
    scores[0, 4] = 1.0
    sel = Fn.indexer_topk(scores, torch.tensor([5]), torch.arange(6), topk=3)
    assert sel[0].nonzero().flatten().tolist() == [0, 1, 4]
    sel = Fn.indexer_topk(torch.randn(3, 6), torch.tensor([0, 1, 2]), torch.arange(6), topk=3)
    assert sel.tolist() == [[j <= t for j in range(6)] for t in range(3)]


def test_indexer_scores_formula():
    torch.manual_seed(4)
    qI, w, kI = torch.randn(2, 4, 8), torch.randn(2, 4), torch.randn(5, 8)
    got = Fn.indexer_scores(qI, w, kI)
    want = torch.tensor(
        [[sum(w[t, h] * max(qI[t, h] @ kI[s], 0.0) for h in range(4)) for s in range(5)] for t in range(2)]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_absorbed_mla_equals_expanded():
    torch.manual_seed(5)
    T, S, h, dn, dr, dv, r = 3, 9, 4, 8, 4, 6, 10
    latent, k_pe = torch.randn(S, r), torch.randn(S, dr)
    w = torch.randn(h, dn + dv, r)
    kv = torch.einsum("sr,hdr->shd", latent, w)
    q_nope, q_pe = torch.randn(T, h, dn), torch.randn(T, h, dr)
    mask = torch.rand(T, S) > 0.3
    mask[:, 0] = True
    a = Fn.mla_attention(q_nope, q_pe, kv[..., :dn], k_pe, kv[..., dn:], mask, 0.2)
    b = Fn.mla_attention_absorbed(q_nope, q_pe, latent, k_pe, w[:, :dn], w[:, dn:], mask, 0.2)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_router_mean_of_sigmoids_bias_only_selects_and_ties_to_lower_id():
    x = torch.zeros(1, 4)
    routers = [torch.zeros(6, 4), torch.zeros(6, 4)]
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    w, idx = Fn.multi_router_topk(x, routers, bias, topk=3, norm_topk_prob=True, scaling=2.5)
    assert idx.tolist() == [[2, 0, 1]]  # bias picks expert 2; the rest tie -> lower ids
    torch.testing.assert_close(w, torch.full((1, 3), 2.5 / 3))  # weights from unbiased scores
    torch.manual_seed(6)
    x, routers = torch.randn(5, 4), [torch.randn(6, 4), torch.randn(6, 4)]
    w, idx = Fn.multi_router_topk(x, routers, torch.zeros(6), topk=2, norm_topk_prob=False, scaling=1.0)
    s = (torch.sigmoid(x @ routers[0].t()) + torch.sigmoid(x @ routers[1].t())) / 2
    torch.testing.assert_close(w, s.topk(2).values)


def test_sinkhorn_is_close_to_doubly_stochastic_and_mhc_combines_transposed():
    torch.manual_seed(7)
    C = sinkhorn(torch.randn(3, 4, 4) * 3, iters=20, eps=1e-6)
    torch.testing.assert_close(C.sum(-2), torch.ones(3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(C.sum(-1), torch.ones(3, 4), atol=5e-2, rtol=0)  # only approximately (spec 10)
    n, H, T = 4, 8, 2
    R = torch.randn(T, n, H)
    fn, base, scale = torch.randn((2 + n) * n, n * H) * 0.1, torch.randn((2 + n) * n), torch.rand(3) + 0.5
    y, post, C = hc_pre(R, fn, base, scale, hc_eps=1e-6, iters=20, rms_eps=1e-6)
    f = torch.randn(T, H)
    out = hc_post(f, R, post, C)
    for t in range(T):
        for i in range(n):
            want = post[t, i] * f[t] + sum(C[t, j, i] * R[t, j] for j in range(n))
            torch.testing.assert_close(out[t, i], want, rtol=1e-5, atol=1e-5)
