"""Triton body of kernels/norm.py: row-wise RMSNorm with fp32 math, optionally followed by RoPE on the row's tail."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    o_ptr,
    o_stride,
    M,
    N,
    eps,
    cos_ptr,
    sin_ptr,
    cs_stride,
    heads,
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """ROWS rows per program, each reduced on its own (the tile shape depends on N only). ROPE > 0: the last
    ROPE columns of each normed row are then rotated (interleaved pairs (2i, 2i+1)) by the cos / sin row of its
    token, row // heads, before the one store; those pairs are loaded again from x (no read of the output)."""
    m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    n = tl.arange(0, BLOCK)
    mm = m < M
    nm = n < N
    msk = mm[:, None] & nm[None, :]
    x = tl.load(x_ptr + m[:, None] * x_stride + n[None, :], mask=msk, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
    y = x * r[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    if ROPE > 0:
        tl.store(
            o_ptr + m[:, None] * o_stride + n[None, :],
            y.to(o_ptr.dtype.element_ty),
            mask=msk & (n < N - ROPE)[None, :],
        )
        HALF: tl.constexpr = ROPE // 2
        c0 = N - ROPE + 2 * tl.arange(0, HALF)
        x0 = tl.load(x_ptr + m[:, None] * x_stride + c0[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + m[:, None] * x_stride + c0[None, :] + 1, mask=mm[:, None], other=0.0).to(tl.float32)
        y0 = x0 * r[:, None]
        y1 = x1 * r[:, None]
        if HAS_W:
            y0 = y0 * tl.load(w_ptr + c0).to(tl.float32)[None, :]
            y1 = y1 * tl.load(w_ptr + c0 + 1).to(tl.float32)[None, :]
        t = m // heads
        i = tl.arange(0, HALF)
        c = tl.load(cos_ptr + t[:, None] * cs_stride + i[None, :], mask=mm[:, None], other=0.0)
        s = tl.load(sin_ptr + t[:, None] * cs_stride + i[None, :], mask=mm[:, None], other=0.0)
        o = o_ptr + m[:, None] * o_stride + c0[None, :]
        tl.store(o, (y0 * c - y1 * s).to(o_ptr.dtype.element_ty), mask=mm[:, None])
        tl.store(o + 1, (y0 * s + y1 * c).to(o_ptr.dtype.element_ty), mask=mm[:, None])
    else:
        tl.store(o_ptr + m[:, None] * o_stride + n[None, :], y.to(o_ptr.dtype.element_ty), mask=msk)
