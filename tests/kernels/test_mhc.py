"""mHC kernels (ours and SGLang's Triton pieces) vs sglang_ernie55.reference.mhc."""

import pytest
import torch

from sglang_ernie55.kernels import mhc as K
from sglang_ernie55.reference import functional as Fn
from sglang_ernie55.reference import mhc as M
from tests.kernels.kutil import DEV, rel


def _params(n, H, rows):
    fn = torch.randn(rows, n * H, device=DEV) * (n * H) ** -0.5
    base = torch.randn(rows, device=DEV) * 0.5
    scale = torch.rand(3, device=DEV) + 0.5
    return fn, base, scale


def _sglang_ok():
    try:
        import sglang.kernels.ops.layernorm.mhc  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


def _check(T, n, H, dtype, backend):
    if backend == "sglang" and not _sglang_ok():
        pytest.skip("SGLang's mhc module does not import here")
    torch.manual_seed(0)
    R = torch.randn(T, n, H, device=DEV).to(dtype)
    fn, base, scale = _params(n, H, (2 + n) * n)
    y, post, C = K.hc_pre(R, fn, base, scale, hc_eps=1e-6, iters=20, rms_eps=1e-6, backend=backend)
    ry, rpost, rC = M.hc_pre(
        R.float().cpu(), fn.cpu(), base.cpu(), scale.cpu(), hc_eps=1e-6, iters=20, rms_eps=1e-6
    )
    tol = 1e-4 if DEV == "cpu" else 2e-3  # cuBLAS may use tf32-free fp32 GEMM; Sinkhorn amplifies little
    assert rel(y.cpu(), ry) < tol and rel(post.cpu(), rpost) < tol and rel(C.cpu(), rC) < tol
    f = torch.randn(T, H, device=DEV).to(dtype)
    out = K.hc_post(f, R, rpost.to(DEV), rC.to(DEV).contiguous())
    ref = M.hc_post(f.float().cpu(), R.float().cpu(), rpost, rC)
    assert rel(out.float().cpu(), ref) < (1e-6 if dtype == torch.float32 else 8e-3)
    hfn, hbase, hscale = _params(n, H, n)
    yh = K.hc_head(R, hfn, hbase, hscale[:1], hc_eps=1e-6, rms_eps=1e-6, backend=backend)
    rh = M.hc_head(R.float().cpu(), hfn.cpu(), hbase.cpu(), hscale[:1].cpu(), hc_eps=1e-6, rms_eps=1e-6)
    assert rel(yh.cpu(), rh) < tol


@pytest.mark.parametrize("backend", ["ours", "sglang"])
def test_mhc_tiny(backend):
    _check(3, 4, 64, torch.float32, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["ours", "sglang"])
@pytest.mark.parametrize("T", [1, 19, 1000])
def test_mhc_full(backend, T):
    _check(T, 4, 4096, torch.bfloat16, backend)


@pytest.mark.parametrize("T", [0, 1, 19, 130])
def test_mhc_tiny_token_counts(T):
    """The token counts of serving (T = 0: an empty batch of a rank / a draft step): shapes, values."""
    _check(T, 4, 64, torch.float32, "ours")


@pytest.mark.parametrize("n, H", [(4, 192), (3, 96), (4, 1100)])
def test_mhc_odd_widths(n, H):
    """Stream counts and hidden widths no tile divides (issue 13's geometries): n = 3 pads the stream axis to
    4 (masked Sinkhorn rows / columns), H = 192 / 96 pad a 256 / 128 block, H = 1100 takes two 1024-blocks
    with a ragged tail."""
    _check(19, n, H, torch.float32, "ours")


def test_mhc_rows_are_independent():
    """A token's result does not depend on the rest of the batch: hc_post bit for bit; hc_pre's fused RMS
    and tail are per token, its mix GEMM (cuBLAS / MKL: batch-invariant under SGLang's deterministic mode,
    not in general) may round differently for another row count, hence 1e-6."""
    torch.manual_seed(1)
    n, H = 4, 64
    R = torch.randn(19, n, H, device=DEV)
    fn, base, scale = _params(n, H, (2 + n) * n)
    f = torch.randn(19, H, device=DEV)
    kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6)
    y, post, C = K.hc_pre(R, fn, base, scale, **kw)
    out = K.hc_post(f, R, post, C)
    for t in (0, 7, 18):
        y1, p1, C1 = K.hc_pre(R[t : t + 1].clone(), fn, base, scale, **kw)
        torch.testing.assert_close(y1[0], y[t], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(C1[0], C[t], atol=1e-6, rtol=1e-6)
        o1 = K.hc_post(
            f[t : t + 1].clone(), R[t : t + 1].clone(), post[t : t + 1].clone(), C[t : t + 1].clone()
        )
        assert torch.equal(o1[0], out[t])


def _check_norm(T, n, H, out_dtype, weighted, R_dtype=torch.float32):
    """hc_pre / hc_head with the sub-layer norm in the tail launch vs the reference's site then its RMSNorm:
    fp32 out to 1e-5 (the norm's fp32 sum order differs from the norm kernel's), bf16 out within one bf16 ulp of
    the reference rounded to bf16 (round to nearest on the GPU; the CPU interpreter truncates); post and C equal
    the unfused call's bit for bit in the interpreter, and to fp32 rounding on the GPU (a whole-row tile takes
    more warps, so the rms sum of the mix is reduced in another order)."""
    g = torch.Generator().manual_seed(T * 1000 + H + n)
    R = torch.randn(T, n, H, generator=g).to(DEV, R_dtype)
    fn, base, scale = _params(n, H, (2 + n) * n)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(DEV) if weighted else None
    eps = 1e-6
    norm = K.SublayerNorm(w, eps, out_dtype)
    kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6)
    x, post, C = K.hc_pre(R, fn, base, scale, norm=norm, **kw)
    _, post0, C0 = K.hc_pre(R, fn, base, scale, **kw)
    assert x.shape == (T, H) and x.dtype == out_dtype
    if DEV == "cpu":
        assert torch.equal(post, post0) and torch.equal(C, C0)
    else:
        torch.testing.assert_close(post, post0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(C, C0, rtol=1e-5, atol=1e-6)
    ry, _, _ = M.hc_pre(R.float().cpu(), fn.cpu(), base.cpu(), scale.cpu(), **kw)
    want = Fn.rms_norm(ry, None if w is None else w.cpu(), eps)
    hfn, hbase, hscale = _params(n, H, n)
    hx = K.hc_head(R, hfn, hbase, hscale[:1], hc_eps=1e-6, rms_eps=1e-6, norm=norm)
    rh = M.hc_head(R.float().cpu(), hfn.cpu(), hbase.cpu(), hscale[:1].cpu(), hc_eps=1e-6, rms_eps=1e-6)
    hwant = Fn.rms_norm(rh, None if w is None else w.cpu(), eps)
    for got, ref in ((x, want), (hx, hwant)):
        # on the GPU the raw mix is a cuBLAS fp32 GEMM (another summation order; the site tests allow 2e-3 of
        # scale): an element may move by that much of the row's largest before its rounding
        floor = 0.0 if DEV == "cpu" else 2e-3 * float(ref.abs().max()) if ref.numel() else 0.0
        if out_dtype == torch.float32:
            torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5 + floor)
        else:
            want_q = ref.to(out_dtype).float()
            torch.testing.assert_close(got.cpu().float(), want_q, rtol=2**-7, atol=1e-6 + floor)


@pytest.mark.parametrize("T", [0, 1, 19])
@pytest.mark.parametrize("n, H", [(4, 64), (3, 96), (4, 1100)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_mhc_fused_sublayer_norm(T, n, H, out_dtype, weighted):
    _check_norm(T, n, H, out_dtype, weighted)


def test_mhc_fused_sublayer_norm_refuses_bad_arguments():
    n, H = 4, 64
    R = torch.randn(2, n, H, device=DEV)
    fn, base, scale = _params(n, H, (2 + n) * n)
    kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6)
    with pytest.raises(ValueError, match="weight contiguous"):
        K.hc_pre(
            R, fn, base, scale, norm=K.SublayerNorm(torch.ones(H + 1, device=DEV), 1e-6, torch.float32), **kw
        )
    with pytest.raises(ValueError, match="float out_dtype"):
        K.hc_pre(R, fn, base, scale, norm=K.SublayerNorm(None, 1e-6, torch.int8), **kw)
    with pytest.raises(ValueError, match="backend 'ours'"):
        K.hc_pre(R, fn, base, scale, norm=K.SublayerNorm(None, 1e-6, torch.float32), backend="sglang", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_mhc_fused_sublayer_norm_full(T):
    _check_norm(T, 4, 4096, torch.bfloat16, True)


def _mix_ref(R, fn):
    x = R.reshape(R.shape[0], R.shape[1] * R.shape[2]).float().cpu()
    return x @ fn.cpu().t(), x.pow(2).sum(-1)


@pytest.mark.parametrize("T", [0, 1, 33, 300])
@pytest.mark.parametrize("n, H", [(4, 64), (3, 96), (4, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mix_equals_the_gemm(T, n, H, dtype):
    """`hc_mix_fused`: the raw mix and each row's sum of squares in one pass over the streams, against the
    fp32 GEMM and sum in torch: row counts no program's rows divide, widths no K step divides, bf16
    streams."""
    g = torch.Generator().manual_seed(T + n * H)
    R = torch.randn(T, n, H, generator=g).to(DEV, dtype)
    fn, _, _ = _params(n, H, (2 + n) * n)
    m, ss = K.hc_mix_fused(R, fn)
    rm, rss = _mix_ref(R, fn)
    assert m.shape == (T, (2 + n) * n) and ss.shape == (T,) and m.dtype == ss.dtype == torch.float32
    if T:
        assert rel(m.cpu(), rm) < 1e-5 and rel(ss.cpu(), rss) < 1e-6


def test_fused_mix_rows_do_not_depend_on_the_batch():
    """A row's mix and sum of squares are the same bits in a batch of 300 and of its last 263 rows (another
    grouping of rows into programs). The interpreter runs the tile's dot on numpy's BLAS, whose blocking moves
    a row's mix by an ulp with its place in the tile: there the mix is held to fp32 rounding."""
    torch.manual_seed(3)
    n, H = 4, 96
    R = torch.randn(300, n, H, device=DEV)
    fn, _, _ = _params(n, H, (2 + n) * n)
    m, ss = K.hc_mix_fused(R, fn)
    m1, ss1 = K.hc_mix_fused(R[37:].clone(), fn)
    assert torch.equal(ss[37:], ss1)
    if DEV == "cpu":
        torch.testing.assert_close(m[37:], m1, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(m[37:], m1)


@pytest.mark.parametrize("norm", [False, True])
def test_fused_mix_sites_equal_the_reference(norm):
    """hc_pre / hc_head with `mix="fused"` at FUSED_MIX_MIN_ROWS + 3 tokens (the tail takes the rows' sums of
    squares instead of reading the streams for them) vs the reference, as the cuBLAS mix is held to, and vs
    the cuBLAS mix's own results to fp32 rounding; below the threshold the call is the cuBLAS mix's, bit for
    bit."""
    torch.manual_seed(4)
    n, H, T = 4, 64, K.FUSED_MIX_MIN_ROWS + 3
    R = torch.randn(T, n, H, device=DEV)
    fn, base, scale = _params(n, H, (2 + n) * n)
    kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6)
    sub = K.SublayerNorm(None, 1e-6, torch.float32) if norm else None
    y, post, C = K.hc_pre(R, fn, base, scale, norm=sub, mix="fused", **kw)
    y0, post0, C0 = K.hc_pre(R, fn, base, scale, norm=sub, mix="cublas", **kw)
    ry, rpost, rC = M.hc_pre(R.cpu(), fn.cpu(), base.cpu(), scale.cpu(), **kw)
    if norm:
        ry = Fn.rms_norm(ry, None, 1e-6)
    tol = 1e-4 if DEV == "cpu" else 2e-3
    assert rel(y.cpu(), ry) < tol and rel(post.cpu(), rpost) < tol and rel(C.cpu(), rC) < tol
    for a, b in ((y, y0), (post, post0), (C, C0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    hfn, hbase, hscale = _params(n, H, n)
    hk = dict(hc_eps=1e-6, rms_eps=1e-6, norm=sub)
    yh = K.hc_head(R, hfn, hbase, hscale[:1], mix="fused", **hk)
    torch.testing.assert_close(
        yh, K.hc_head(R, hfn, hbase, hscale[:1], mix="cublas", **hk), rtol=1e-5, atol=1e-6
    )
    small = R[: K.FUSED_MIX_MIN_ROWS - 1]
    a = K.hc_pre(small, fn, base, scale, norm=sub, mix="fused", **kw)
    b = K.hc_pre(small, fn, base, scale, norm=sub, mix="cublas", **kw)
    assert all(torch.equal(x, z) for x, z in zip(a, b))


def test_mix_knob_is_checked(monkeypatch):
    """SGLANG_ERNIE55_MHC_MIX takes cublas / fused; another value is refused, naming them, before a launch."""
    n, H = 4, 64
    R = torch.randn(2, n, H, device=DEV)
    fn, base, scale = _params(n, H, (2 + n) * n)
    monkeypatch.setenv("SGLANG_ERNIE55_MHC_MIX", "cutlass")
    with pytest.raises(ValueError, match="SGLANG_ERNIE55_MHC_MIX='cutlass': legal values are cublas, fused"):
        K.hc_pre(R, fn, base, scale, hc_eps=1e-6, iters=20, rms_eps=1e-6)
    monkeypatch.setenv("SGLANG_ERNIE55_MHC_MIX", "Fused")
    y, _, _ = K.hc_pre(R, fn, base, scale, hc_eps=1e-6, iters=20, rms_eps=1e-6)
    assert y.shape == (2, H)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [256, 8192])
def test_fused_mix_full(T):
    """Full width (4 streams x 4096) at a prefill chunk's row counts, bf16 streams: against the fp32 GEMM."""
    torch.manual_seed(5)
    R = torch.randn(T, 4, 4096, device=DEV).to(torch.bfloat16)
    fn, _, _ = _params(4, 4096, 24)
    m, ss = K.hc_mix_fused(R, fn)
    rm, rss = _mix_ref(R, fn)
    assert rel(m.cpu(), rm) < 1e-5 and rel(ss.cpu(), rss) < 1e-6


def _post_args(T, n, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(T, n, H, generator=g).to(DEV, dtype)
    f = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    post = (torch.rand(T, n, generator=g) * 2).to(DEV)
    C = torch.softmax(torch.randn(T, n, n, generator=g), -1).to(DEV)
    return f, R, post, C


@pytest.mark.parametrize("T", [0, 1, 33, 300])
@pytest.mark.parametrize("n, H", [(4, 64), (3, 96), (4, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_mix_is_hc_post_then_the_mix(T, n, H, dtype):
    """`hc_post_mix`: R' with `hc_post`'s bits, and the next site's mix and sums of squares of R' as written
    (rounded to R's dtype), against the fp32 GEMM in torch; rows no program's rows divide, widths no K step
    divides, three streams (padded to four in the tile), bf16 streams."""
    f, R, post, C = _post_args(T, n, H, dtype, T + n * H)
    fn, _, _ = _params(n, H, (2 + n) * n)
    out, (m, ss) = K.hc_post_mix(f, R, post, C, fn)
    assert out.dtype == dtype and m.shape == (T, (2 + n) * n) and ss.shape == (T,)
    assert torch.equal(out, K.hc_post(f, R, post, C))
    if T:
        rm, rss = _mix_ref(out, fn)
        assert rel(m.cpu(), rm) < 1e-5 and rel(ss.cpu(), rss) < 1e-6


def test_post_mix_rows_do_not_depend_on_the_batch():
    """As the fused mix: a row's R', mix and sum of squares are the same in a batch of 300 and of its last 263
    rows (the mix to fp32 rounding in the interpreter, whose dot is numpy's)."""
    n, H = 4, 96
    f, R, post, C = _post_args(300, n, H, torch.float32, 7)
    fn, _, _ = _params(n, H, (2 + n) * n)
    out, (m, ss) = K.hc_post_mix(f, R, post, C, fn)
    out1, (m1, ss1) = K.hc_post_mix(*(x[37:].clone() for x in (f, R, post, C)), fn)
    assert torch.equal(out[37:], out1) and torch.equal(ss[37:], ss1)
    if DEV == "cpu":
        torch.testing.assert_close(m[37:], m1, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(m[37:], m1)


@pytest.mark.parametrize("norm", [False, True])
def test_sites_take_the_previous_posts_mix(norm):
    """hc_pre / hc_head given `mixed` from `hc_post_mix` equal the same sites with the fused mix of R' (the
    tail then reads R' only for its combination), to fp32 rounding; a `mixed` of the wrong shape, or with
    SGLang's backend, is refused."""
    n, H, T = 4, 64, K.FUSED_MIX_MIN_ROWS + 3
    f, R, post, C = _post_args(T, n, H, torch.float32, 11)
    fn, base, scale = _params(n, H, (2 + n) * n)
    kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6)
    sub = K.SublayerNorm(None, 1e-6, torch.float32) if norm else None
    R2, mixed = K.hc_post_mix(f, R, post, C, fn)
    got = K.hc_pre(R2, fn, base, scale, norm=sub, mixed=mixed, **kw)
    want = K.hc_pre(R2, fn, base, scale, norm=sub, mix="fused", **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    hfn, hbase, hscale = _params(n, H, n)
    R3, hmixed = K.hc_post_mix(f, R, post, C, hfn)
    hk = dict(hc_eps=1e-6, rms_eps=1e-6, norm=sub)
    torch.testing.assert_close(
        K.hc_head(R3, hfn, hbase, hscale[:1], mixed=hmixed, **hk),
        K.hc_head(R3, hfn, hbase, hscale[:1], mix="fused", **hk),
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match=r"mixed: m fp32 \[259, 24\]"):
        K.hc_pre(R2, fn, base, scale, mixed=hmixed, **kw)
    with pytest.raises(ValueError, match="`mixed` needs backend 'ours'"):
        K.hc_pre(R2, fn, base, scale, mixed=mixed, backend="sglang", **kw)


def test_post_mix_rule(monkeypatch):
    """`post_mixes`: the fused mix's rule (the knob, FUSED_MIX_MIN_ROWS tokens and more), at most 4 streams;
    `hc_post_mix` refuses more."""
    assert not K.post_mixes(10_000, 4, "cublas") and not K.post_mixes(K.FUSED_MIX_MIN_ROWS - 1, 4, "fused")
    assert K.post_mixes(K.FUSED_MIX_MIN_ROWS, 4, "fused") and not K.post_mixes(10_000, 5, "fused")
    monkeypatch.setenv("SGLANG_ERNIE55_MHC_MIX", "fused")
    assert K.post_mixes(K.FUSED_MIX_MIN_ROWS, 4)
    with pytest.raises(ValueError, match="mix: one of"):
        K.post_mixes(300, 4, "cutlass")
    f, R, post, C = _post_args(3, 5, 32, torch.float32, 0)
    with pytest.raises(ValueError, match="hc_post_mix: at most 4 streams, got 5"):
        K.hc_post_mix(f, R, post, C, torch.zeros(35, 160, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [256, 8192])
def test_post_mix_full(T):
    """Full width (4 streams x 4096, fp32 streams) at a prefill chunk's row counts: R' bit-equal to hc_post's,
    the mix against the fp32 GEMM of R'."""
    f, R, post, C = _post_args(T, 4, 4096, torch.float32, T)
    fn, _, _ = _params(4, 4096, 24)
    out, (m, ss) = K.hc_post_mix(f, R, post, C, fn)
    assert torch.equal(out, K.hc_post(f, R, post, C))
    rm, rss = _mix_ref(out, fn)
    assert rel(m.cpu(), rm) < 1e-5 and rel(ss.cpu(), rss) < 1e-6
