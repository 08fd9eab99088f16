"""Triton body of kernels/norm.py: row-wise RMSNorm with fp32 math."""

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
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """ROWS rows per program, each reduced on its own (the tile shape depends on N only)."""
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
    tl.store(o_ptr + m[:, None] * o_stride + n[None, :], y.to(o_ptr.dtype.element_ty), mask=msk)
