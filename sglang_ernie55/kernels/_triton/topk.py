"""Triton body of kernels/indexer.py `indexer_topk`: an exact radix select per query row, one program per row.

A logit is ordered through its order-preserving uint32 (-0 read as +0, so equal floats tie). Four 8-bit passes
narrow the k-th largest value to one uint32 u*; a last pass walks the keys in position order and writes every
key above u* and the first keys equal to it, until k, as positions or cache slots, then -1. SAMPLE: the
kernel's docstring."""

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
def _kth(src, n, need, BLOCK: tl.constexpr):
    """(u*, how many keys equal to u* are taken) for the need-th largest of the n logits at src."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)
    prefix = tl.zeros((), dtype=tl.uint32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((512,), dtype=tl.int32)
        for s0 in range(0, n, BLOCK):
            s = s0 + offs
            m = s < n
            u = _ordered(tl.load(src + s, mask=m, other=0.0))
            if p > 0:
                m = m & ((u >> (shift + 8)) == prefix)
            digit = ((u >> shift) & 0xFF).to(tl.int32)
            hist += tl.histogram(tl.where(m, digit, 256), 512)
        hist = tl.where(bins < 256, hist, 0)
        above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys of this prefix with a larger digit
        d = tl.min(tl.where(above < need, bins, 512), 0)  # the digit holding the need-th largest key
        need -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = (prefix << 8) | d.to(tl.uint32)
    return prefix, need


@triton.jit
def _emit(
    src,
    src_pos,
    cand,
    n,
    prefix,
    need,
    dst,
    req,
    pt_ptr,
    pt_stride,
    page_size,
    SLOTS: tl.constexpr,
    FROM_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Walk the n logits at src in position order and write the keys above u* and the first `need` equal to it
    to dst. Their positions: their index (FROM_ROW, or when `cand` is false) or src_pos's entries."""
    offs = tl.arange(0, BLOCK)
    written = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for s0 in range(0, n, BLOCK):
        i = s0 + offs
        m = i < n
        u = _ordered(tl.load(src + i, mask=m, other=0.0))
        if FROM_ROW:
            s = i
        else:
            s = tl.where(cand, tl.load(src_pos + i, mask=m & cand, other=0), i)
        eq = m & (u == prefix)
        rank = ties + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among keys equal to u*
        sel = (m & (u > prefix)) | (eq & (rank <= need))
        at = written + tl.cumsum(sel.to(tl.int32), 0) - 1
        if SLOTS:
            page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=sel, other=0).to(tl.int64)
            val = (page * page_size + s % page_size).to(tl.int32)
        else:
            val = s
        tl.store(dst + at, val, mask=sel)
        written += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)


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
    cand_ptr,
    cand_pos_ptr,
    width,
    page_size,
    K,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SAMPLE: tl.constexpr,
    CAP: tl.constexpr,
):
    """SAMPLE (> 0): a row of n keys with 2 SAMPLE <= n <= K SAMPLE / 8 first sorts SAMPLE evenly spaced keys
    and takes as threshold the one of rank e + 4 sqrt(e) + 4, e = K SAMPLE / n (the expected rank of the k-th
    largest key, plus a margin). One pass copies the keys at or above it (logit and position, in position
    order) to the row's CAP candidates. When there are at least K and at most CAP of them they hold every key
    of the top k, so the radix passes and the write run over them instead of the row, with the same
    selection; otherwise over the row, as without SAMPLE."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)  # causal keys s < n
    take = tl.minimum(n, K)
    row = lg_ptr + t * lg_stride
    req = tl.load(req_ptr + t).to(tl.int64)
    dst = out_ptr + t * out_stride
    offs = tl.arange(0, BLOCK)
    # u* and how many keys equal to it are taken (with at most K keys all: u* = 0 is below every key)
    prefix = tl.zeros((), dtype=tl.uint32)
    need = take
    src = row
    cnt = n
    cand = n < 0  # the candidates replace the row
    if n > K:
        if SAMPLE > 0:
            c = tl.zeros((), dtype=tl.int32)
            if (n >= 2 * SAMPLE) & (n <= K * (SAMPLE // 8)):
                j = tl.arange(0, SAMPLE)
                v = tl.sort(tl.load(row + (j.to(tl.int64) * n) // SAMPLE), descending=True)
                e = (K * SAMPLE / n).to(tl.float32)
                r = tl.minimum((e + 4.0 * tl.sqrt(e) + 4.0).to(tl.int32), SAMPLE - 1)
                tau = _ordered(tl.sum(tl.where(j == r, v, 0.0), 0))
                for s0 in range(0, n, BLOCK):
                    s = s0 + offs
                    x = tl.load(row + s, mask=s < n, other=0.0)
                    sel = (s < n) & (_ordered(x) >= tau)
                    at = c + tl.cumsum(sel.to(tl.int32), 0) - 1
                    keep = sel & (at < CAP)
                    tl.store(cand_ptr + t * CAP + at, x, mask=keep)
                    tl.store(cand_pos_ptr + t * CAP + at, s, mask=keep)
                    c += tl.sum(sel.to(tl.int32), 0)
            if (c >= K) & (c <= CAP):
                src = cand_ptr + t * CAP
                cnt = c
                cand = c >= 0
        prefix, need = _kth(src, cnt, K, BLOCK)
    _emit(
        src,
        cand_pos_ptr + t * CAP,
        cand,
        cnt,
        prefix,
        need,
        dst,
        req,
        pt_ptr,
        pt_stride,
        page_size,
        SLOTS,
        SAMPLE == 0,
        BLOCK,
    )
    for j0 in range(0, TOPK, BLOCK):
        j = j0 + offs
        tl.store(dst + j, tl.full((BLOCK,), -1, tl.int32), mask=(j >= take) & (j < TOPK))
    tl.store(len_ptr + t, take)
