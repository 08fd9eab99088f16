"""Triton bodies of kernels/kv_store.py: quantise tokens into a paged pool (one program per token), and read
them back dequantised (`kv_load_kernel`).

A token row is [main MAIN | tail TAIL]; each segment is held at its padded width (MAIN_P, TAIL_P: powers of
two) with the columns past the real width masked (read as 0, not stored)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, encode_store, load_main, round_bf16, token_rows


@triton.jit
def kv_store_kernel(
    x_ptr,
    x_stride,
    loc_ptr,
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    page_size,
    page_bytes,
    data_stride,
    scale_base,
    scale_stride,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    TAIL_OFF: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(loc_ptr + i).to(tl.int64)
    if slot < 0:
        return
    row, srow = token_rows(slot, page_size, page_bytes, data_stride, scale_base, scale_stride)
    xrow = x_ptr + i.to(tl.int64) * x_stride
    d = tl.arange(0, MAIN_P)
    if MAIN_P > MAIN:  # the padding columns must read 0: they share the fp8 amax of the last tile
        x = tl.load(xrow + d, mask=d < MAIN, other=0.0).to(tl.float32)
    else:
        x = tl.load(xrow + d).to(tl.float32)
    encode_store(x, row, srow, u8_ptr, f8_ptr, bf_ptr, f32_ptr, KIND, MAIN, MAIN_P, NOPE, TILE, SCALE_BYTES)
    if TAIL > 0:
        dt = tl.arange(0, TAIL_P)
        # round in integer arithmetic first (the interpreter's fp32 -> bf16 cast truncates)
        if TAIL_P > TAIL:
            xt = tl.load(xrow + MAIN + dt, mask=dt < TAIL, other=0.0).to(tl.float32)
            tl.store(bf_ptr + (row + TAIL_OFF + 2 * dt) // 2, round_bf16(xt).to(tl.bfloat16), mask=dt < TAIL)
        else:
            xt = tl.load(xrow + MAIN + dt).to(tl.float32)
            tl.store(bf_ptr + (row + TAIL_OFF + 2 * dt) // 2, round_bf16(xt).to(tl.bfloat16))


@triton.jit
def kv_load_kernel(
    out_ptr,
    out_stride,
    loc_ptr,
    n,
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    page_size,
    page_bytes,
    data_stride,
    scale_base,
    scale_stride,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    TAIL_OFF: tl.constexpr,
    BN: tl.constexpr,
):
    """BN tokens per program: out[i] = [main | tail] of pool slot loc[i] (0 where loc[i] < 0), in out's dtype."""
    i = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    inside = i < n
    slot = tl.load(loc_ptr + i, mask=inside, other=-1).to(tl.int64)
    valid = slot >= 0
    row, srow = token_rows(tl.maximum(slot, 0), page_size, page_bytes, data_stride, scale_base, scale_stride)
    v = load_main(u8_ptr, f8_ptr, bf_ptr, f32_ptr, row, srow, valid, KIND, MAIN, MAIN_P, NOPE, TILE, BN)
    d = tl.arange(0, MAIN_P)
    orow = out_ptr + i[:, None] * out_stride
    tl.store(orow + d[None, :], v.to(out_ptr.dtype.element_ty), mask=cols(inside[:, None], d, MAIN, MAIN_P))
    if TAIL > 0:
        dt = tl.arange(0, TAIL_P)
        m = cols(valid[:, None], dt, TAIL, TAIL_P)
        t = tl.load(bf_ptr + (row[:, None] + TAIL_OFF + 2 * dt[None, :]) // 2, mask=m, other=0.0)
        tl.store(
            orow + MAIN + dt[None, :],
            t.to(out_ptr.dtype.element_ty),
            mask=cols(inside[:, None], dt, TAIL, TAIL_P),
        )
