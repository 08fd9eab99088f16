"""Triton body of kernels/rope.py: RoPE (or its inverse) on a slice of the last dim, in place."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_inplace_kernel(
    x_ptr,
    x_stride_t,
    x_stride_h,
    H,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    START: tl.constexpr,
    ROPE: tl.constexpr,
    BH: tl.constexpr,
    SIGN: tl.constexpr,
    NEOX: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
):
    """Grid (token, head block). The slice x[t, h, START : START + ROPE] rotates: pairs (2i, 2i+1)
    (interleaved) or (i, i + ROPE/2) (NEOX, rotate-half). Table row: positions[t], or t (TOKEN_ROWS)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    HALF: tl.constexpr = ROPE // 2
    i = tl.arange(0, HALF)
    if TOKEN_ROWS:
        p = t
    else:
        p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + p * cs_stride + i)
    s = tl.load(sin_ptr + p * cs_stride + i) * SIGN
    row = x_ptr + t * x_stride_t + h[:, None] * x_stride_h + START
    if NEOX:
        p0 = row + i[None, :]
        x0 = tl.load(p0, mask=hm[:, None]).to(tl.float32)
        x1 = tl.load(p0 + HALF, mask=hm[:, None]).to(tl.float32)
    else:
        # the slice read and written whole (contiguous), its pairs split in registers: two stride-2 accesses
        # per half would each move half-used sectors, and their partial stores interleave
        p0 = row + tl.arange(0, ROPE)[None, :]
        x0, x1 = tl.split(tl.reshape(tl.load(p0, mask=hm[:, None]).to(tl.float32), (BH, HALF, 2)))
    y0 = (x0 * c[None, :] - x1 * s[None, :]).to(x_ptr.dtype.element_ty)
    y1 = (x0 * s[None, :] + x1 * c[None, :]).to(x_ptr.dtype.element_ty)
    if NEOX:
        tl.store(p0, y0, mask=hm[:, None])
        tl.store(p0 + HALF, y1, mask=hm[:, None])
    else:
        tl.store(p0, tl.reshape(tl.join(y0, y1), (BH, ROPE)), mask=hm[:, None])
