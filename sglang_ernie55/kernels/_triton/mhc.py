"""Triton bodies of kernels/mhc.py: the per-token tail of hc_pre (split + Sinkhorn + weighted sum of
the streams) and hc_post (combine)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hc_pre_tail_kernel(
    m_ptr,
    m_stride,
    base_ptr,
    scale_ptr,
    r_ptr,
    r_stride_t,
    r_stride_n,
    H,
    pre_ptr,
    post_ptr,
    c_ptr,
    y_ptr,
    y_stride,
    hc_eps,
    rms_eps,
    w_ptr,
    norm_eps,
    ss_ptr,
    N: tl.constexpr,
    NP: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD: tl.constexpr,
    RMS: tl.constexpr,
    SS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_W: tl.constexpr,
    NBLOCK: tl.constexpr,
):
    """One program per token. m row = [pre N | post N | comb N*N] (HEAD: [pre N] only). RMS: m holds the
    raw mix x @ fn^T and the program scales it by rsqrt(mean(x^2) + rms_eps) over its own row of R, or with SS
    over the row's sum of squares at ss_ptr (`hc_mix_kernel` made both: R is then read once here).
    NORM: the row y = sum_i pre[i] R[i] is built whole in one NBLOCK (>= H) tile, stream by stream, and the
    program writes the sub-layer's RMSNorm of it, y * rsqrt(mean(y^2) + norm_eps) [* w], rounded once to
    y_ptr's dtype, instead of y."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    im = i < N
    if SS:
        rr = tl.rsqrt(tl.load(ss_ptr + t) / (N * H) + rms_eps)
    elif RMS:
        ss = tl.zeros([NP], tl.float32)
        for h0 in range(0, H, BLOCK):
            h = h0 + tl.arange(0, BLOCK)
            r = tl.load(
                r_ptr + t * r_stride_t + i[:, None] * r_stride_n + h[None, :],
                mask=im[:, None] & (h < H)[None, :],
                other=0.0,
            ).to(tl.float32)
            ss += tl.sum(r * r, 1)
        rr = tl.rsqrt(tl.sum(ss, 0) / (N * H) + rms_eps)
    else:
        rr = 1.0
    s0 = tl.load(scale_ptr)
    pre = tl.sigmoid(
        tl.load(m_ptr + t * m_stride + i, mask=im, other=0.0) * rr * s0
        + tl.load(base_ptr + i, mask=im, other=0.0)
    )
    pre = tl.where(im, pre + hc_eps, 0.0)
    if not HEAD:
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        post = 2.0 * tl.sigmoid(
            tl.load(m_ptr + t * m_stride + N + i, mask=im, other=0.0) * rr * s1
            + tl.load(base_ptr + N + i, mask=im, other=0.0)
        )
        tl.store(pre_ptr + t * N + i, pre, mask=im)
        tl.store(post_ptr + t * N + i, post, mask=im)
        jj = i[:, None]
        kk = i[None, :]
        mm = (jj < N) & (kk < N)
        off = 2 * N + jj * N + kk
        c = tl.load(m_ptr + t * m_stride + off, mask=mm, other=0.0) * rr * s2 + tl.load(
            base_ptr + off, mask=mm, other=0.0
        )
        c = tl.where(mm, c, float("-inf"))
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = tl.where(mm, c, 0.0)
        c = tl.where(mm, c / tl.sum(c, 1)[:, None] + hc_eps, 0.0)
        c = tl.where(mm, c / (tl.sum(c, 0)[None, :] + hc_eps), 0.0)
        for _ in tl.static_range(ITERS - 1):
            c = tl.where(mm, c / (tl.sum(c, 1)[:, None] + hc_eps), 0.0)
            c = tl.where(mm, c / (tl.sum(c, 0)[None, :] + hc_eps), 0.0)
        tl.store(c_ptr + t * N * N + jj * N + kk, c, mask=mm)
    # y = sum_i pre[i] * R[i]
    if NORM:
        h = tl.arange(0, NBLOCK)
        hm = h < H
        y = tl.zeros([NBLOCK], tl.float32)
        for j in tl.static_range(N):
            pj = tl.sum(tl.where(i == j, pre, 0.0), 0)
            rj = tl.load(r_ptr + t * r_stride_t + j * r_stride_n + h, mask=hm, other=0.0).to(tl.float32)
            y += pj * rj
        x = y * tl.rsqrt(tl.sum(y * y, 0) / H + norm_eps)
        if HAS_W:
            x = x * tl.load(w_ptr + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * y_stride + h, x.to(y_ptr.dtype.element_ty), mask=hm)
    else:
        for h0 in range(0, H, BLOCK):
            h = h0 + tl.arange(0, BLOCK)
            hm = h < H
            r = tl.load(
                r_ptr + t * r_stride_t + i[:, None] * r_stride_n + h[None, :],
                mask=im[:, None] & hm[None, :],
                other=0.0,
            ).to(tl.float32)
            tl.store(y_ptr + t * y_stride + h, tl.sum(pre[:, None] * r, 0), mask=hm)


@triton.jit
def hc_mix_kernel(
    x_ptr,
    x_stride,
    fn_ptr,
    fn_stride,
    m_ptr,
    m_stride,
    ss_ptr,
    T,
    K,
    NR,
    NRP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Programs of BM token rows of x [T, K] (the flattened streams): m = x @ fn^T [T, NR] in IEEE fp32 and
    each row's sum of squares, reading x once. A row's sums run over K in the same order in every program,
    whatever the batch."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < T
    rows64 = rows.to(tl.int64)
    j = tl.arange(0, NRP)
    jm = j < NR
    acc = tl.zeros([BM, NRP], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        x = tl.load(
            x_ptr + rows64[:, None] * x_stride + k[None, :], mask=rm[:, None] & km[None, :], other=0.0
        ).to(tl.float32)
        f = tl.load(fn_ptr + j[:, None] * fn_stride + k[None, :], mask=jm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(f), input_precision="ieee")
        ss += tl.sum(x * x, 1)
    tl.store(m_ptr + rows64[:, None] * m_stride + j[None, :], acc, mask=rm[:, None] & jm[None, :])
    tl.store(ss_ptr + rows64, ss, mask=rm)


@triton.jit
def hc_post_kernel(
    f_ptr,
    f_stride,
    r_ptr,
    r_stride_t,
    r_stride_n,
    post_ptr,
    c_ptr,
    o_ptr,
    o_stride_t,
    o_stride_n,
    H,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """R'[i] = post[i] * f + sum_j C[j, i] * R[j]; grid (token, H block)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hm = h < H
    i = tl.arange(0, NP)
    im = i < N
    f = tl.load(f_ptr + t * f_stride + h, mask=hm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + i, mask=im, other=0.0)
    acc = post[:, None] * f[None, :]
    for j in tl.static_range(N):
        rj = tl.load(r_ptr + t * r_stride_t + j * r_stride_n + h, mask=hm, other=0.0).to(tl.float32)
        cj = tl.load(c_ptr + t * N * N + j * N + i, mask=im, other=0.0)  # C[j, :]
        acc += cj[:, None] * rj[None, :]
    tl.store(
        o_ptr + t * o_stride_t + i[:, None] * o_stride_n + h[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=im[:, None] & hm[None, :],
    )


@triton.jit
def _stream(r_ptr, rows64, r_stride_t, r_stride_n, j, h, rh):
    return tl.load(r_ptr + rows64[:, None] * r_stride_t + j * r_stride_n + h[None, :], mask=rh, other=0.0).to(
        tl.float32
    )


@triton.jit
def _c(c_ptr, rows64, rm, j, i, N: tl.constexpr):
    """C[j, i] of the tile's rows."""
    return tl.load(c_ptr + rows64 * (N * N) + j * N + i, mask=rm, other=0.0)[:, None]


@triton.jit
def hc_post_mix_kernel(
    f_ptr,
    f_stride,
    r_ptr,
    r_stride_t,
    r_stride_n,
    post_ptr,
    c_ptr,
    o_ptr,
    o_stride_t,
    o_stride_n,
    fn_ptr,
    fn_stride,
    m_ptr,
    m_stride,
    ss_ptr,
    T,
    H,
    NR,
    N: tl.constexpr,
    NRP: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """`hc_post_kernel` and the next site's `hc_mix_kernel` in one pass, programs of BM tokens (N <= 4
    streams, each held in its own registers): R'[i] = post[i] f + sum_j C[j, i] R[j] is written, and
    m = x' @ fn^T [T, NR] (IEEE fp32) and sum(x'^2) per row are taken over x' = R' flattened as written
    (rounded to o_ptr's dtype), so the next site reads no stream for its mix."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < T
    rows64 = rows.to(tl.int64)
    j = tl.arange(0, NRP)
    jm = j < NR
    acc = tl.zeros([BM, NRP], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for h0 in range(0, H, BK):
        h = h0 + tl.arange(0, BK)
        hm = h < H
        rh = rm[:, None] & hm[None, :]
        f = tl.load(f_ptr + rows64[:, None] * f_stride + h[None, :], mask=rh, other=0.0).to(tl.float32)
        r0 = _stream(r_ptr, rows64, r_stride_t, r_stride_n, 0, h, rh)
        if N > 1:
            r1 = _stream(r_ptr, rows64, r_stride_t, r_stride_n, 1, h, rh)
        if N > 2:
            r2 = _stream(r_ptr, rows64, r_stride_t, r_stride_n, 2, h, rh)
        if N > 3:
            r3 = _stream(r_ptr, rows64, r_stride_t, r_stride_n, 3, h, rh)
        for i in tl.static_range(N):
            # hc_post_kernel's operations in its order, so R' has its bits
            y = tl.load(post_ptr + rows64 * N + i, mask=rm, other=0.0)[:, None] * f
            y += _c(c_ptr, rows64, rm, 0, i, N) * r0
            if N > 1:
                y += _c(c_ptr, rows64, rm, 1, i, N) * r1
            if N > 2:
                y += _c(c_ptr, rows64, rm, 2, i, N) * r2
            if N > 3:
                y += _c(c_ptr, rows64, rm, 3, i, N) * r3
            y = y.to(o_ptr.dtype.element_ty)
            tl.store(o_ptr + rows64[:, None] * o_stride_t + i * o_stride_n + h[None, :], y, mask=rh)
            x = y.to(tl.float32)
            w = tl.load(
                fn_ptr + j[:, None] * fn_stride + i * H + h[None, :],
                mask=jm[:, None] & hm[None, :],
                other=0.0,
            )
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            ss += tl.sum(x * x, 1)
    tl.store(m_ptr + rows64[:, None] * m_stride + j[None, :], acc, mask=rm[:, None] & jm[None, :])
    tl.store(ss_ptr + rows64, ss, mask=rm)
