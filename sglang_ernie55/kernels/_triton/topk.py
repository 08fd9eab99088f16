"""Triton body of kernels/indexer.py `indexer_topk`: an exact radix select per query row, one program per row.

A logit is ordered through its order-preserving uint32 (-0 read as +0, so equal floats tie). Four 8-bit passes
over the row's causal keys narrow the k-th largest value to one uint32 u*; the last pass walks the keys in
position order and writes every key above u* and the first keys equal to it, until k are written, as positions
or as cache slots through the page table, then -1 to the row's end."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ordered(x):
    """The order-preserving uint32 of fp32 x, with -0.0 read as +0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    # negatives: all bits flipped (larger magnitude, smaller key); non-negatives: the sign bit set, above them
    return tl.where(b < 0, ~b, b ^ (-2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def indexer_topk_kernel(
    lg_ptr,
    lg_stride,
    pos_ptr,
    req_ptr,
    pt_ptr,
    pt_stride,
    out_ptr,
    out_stride,
    len_ptr,
    width,
    page_size,
    K,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)  # causal keys s < n
    take = tl.minimum(n, K)
    row = lg_ptr + t * lg_stride
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)
    # u* and how many keys equal to it are taken (all keys when there are at most K)
    prefix = tl.zeros((), dtype=tl.uint32)
    need = take  # with at most K keys, u* = 0 is below every key: all are taken
    if n > K:
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros((512,), dtype=tl.int32)
            for s0 in range(0, n, BLOCK):
                s = s0 + offs
                m = s < n
                u = _ordered(tl.load(row + s, mask=m, other=0.0))
                if p > 0:
                    m = m & ((u >> (shift + 8)) == prefix)
                digit = ((u >> shift) & 0xFF).to(tl.int32)
                hist += tl.histogram(tl.where(m, digit, 256), 512)
            hist = tl.where(bins < 256, hist, 0)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys of this prefix with a larger digit
            d = tl.min(tl.where(above < need, bins, 512), 0)  # the digit holding the need-th largest key
            need -= tl.sum(tl.where(bins > d, hist, 0), 0)
            prefix = (prefix << 8) | d.to(tl.uint32)
    req = tl.load(req_ptr + t).to(tl.int64)
    written = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for s0 in range(0, n, BLOCK):
        s = s0 + offs
        m = s < n
        u = _ordered(tl.load(row + s, mask=m, other=0.0))
        eq = m & (u == prefix)
        rank = ties + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among keys equal to u*
        sel = (m & (u > prefix)) | (eq & (rank <= need))
        at = written + tl.cumsum(sel.to(tl.int32), 0) - 1
        if SLOTS:
            page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=sel, other=0).to(tl.int64)
            val = (page * page_size + s % page_size).to(tl.int32)
        else:
            val = s
        tl.store(out_ptr + t * out_stride + at, val, mask=sel)
        written += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)
    for j0 in range(0, TOPK, BLOCK):
        j = j0 + offs
        tl.store(out_ptr + t * out_stride + j, tl.full((BLOCK,), -1, tl.int32), mask=(j >= take) & (j < TOPK))
    tl.store(len_ptr + t, take)
