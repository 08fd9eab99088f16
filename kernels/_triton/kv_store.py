"""Triton body of kernels/kv_store.py: quantise tokens into a paged pool (one program per token)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import pow2_exponent, pow2_float, round_e4m3, token_rows


@triton.jit
def kv_store_kernel(
    x_ptr, x_stride, loc_ptr, u8_ptr, f8_ptr, bf_ptr, f32_ptr,
    page_size, page_bytes, data_stride, scale_base, scale_stride,
    KIND: tl.constexpr, MAIN: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr,
    TAIL: tl.constexpr, TAIL_OFF: tl.constexpr, SCALE_BYTES: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    slot = tl.load(loc_ptr + i).to(tl.int64)
    if slot < 0:
        return
    row, srow = token_rows(slot, page_size, page_bytes, data_stride, scale_base, scale_stride)
    xrow = x_ptr + i.to(tl.int64) * x_stride
    d = tl.arange(0, MAIN)
    x = tl.load(xrow + d).to(tl.float32)
    if KIND == 0:
        tl.store(bf_ptr + (row + 2 * d) // 2, x.to(tl.bfloat16))
    else:
        NT: tl.constexpr = MAIN // TILE
        NQT: tl.constexpr = NOPE // TILE
        t = tl.arange(0, NT)
        is_q = d < NOPE
        x3 = tl.reshape(x, (NT, TILE))
        amax = tl.max(tl.abs(x3), axis=1)
        amax = tl.maximum(amax, 1e-8)
        e = pow2_exponent(amax)
        inv = pow2_float(-e)
        q = tl.reshape(x3 * inv[:, None], (MAIN,))
        q = round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
        tl.store(f8_ptr + row + d, q.to(f8_ptr.dtype.element_ty), mask=is_q)
        if NOPE < MAIN:
            tl.store(bf_ptr + (row + NOPE + 2 * (d - NOPE)) // 2, x.to(tl.bfloat16), mask=d >= NOPE)
        if KIND == 1:
            sb = tl.where(t < NQT, e + 127, 0).to(tl.uint8)
            tl.store(u8_ptr + srow + t, sb, mask=t < SCALE_BYTES)
        else:
            tl.store(f32_ptr + (srow + 4 * t) // 4, pow2_float(e), mask=t < NQT)
    if TAIL > 0:
        dt = tl.arange(0, TAIL)
        xt = tl.load(xrow + MAIN + dt)
        tl.store(bf_ptr + (row + TAIL_OFF + 2 * dt) // 2, xt.to(tl.bfloat16))
