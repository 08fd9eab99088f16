"""Triton body of kernels/rope.py: interleaved RoPE (or its inverse) on the last dims, in place."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_inplace_kernel(
    x_ptr, x_stride_t, x_stride_h, H, pos_ptr, cos_ptr, sin_ptr, cs_stride,
    D: tl.constexpr, ROPE: tl.constexpr, BH: tl.constexpr, SIGN: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    HALF: tl.constexpr = ROPE // 2
    i = tl.arange(0, HALF)
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + p * cs_stride + i)
    s = tl.load(sin_ptr + p * cs_stride + i) * SIGN
    base = x_ptr + t * x_stride_t + h[:, None] * x_stride_h + (D - ROPE) + 2 * i[None, :]
    x0 = tl.load(base, mask=hm[:, None]).to(tl.float32)
    x1 = tl.load(base + 1, mask=hm[:, None]).to(tl.float32)
    y0 = x0 * c[None, :] - x1 * s[None, :]
    y1 = x0 * s[None, :] + x1 * c[None, :]
    tl.store(base, y0.to(x_ptr.dtype.element_ty), mask=hm[:, None])
    tl.store(base + 1, y1.to(x_ptr.dtype.element_ty), mask=hm[:, None])
