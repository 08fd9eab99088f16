"""Triton bodies of kernels/indexer.py `indexer_topk`: an exact radix select per query row.

A logit is ordered through its order-preserving uint32 (-0 read as +0, so equal floats tie). Four 8-bit passes
over the row's causal keys narrow the k-th largest value to one uint32 u*; the last pass walks the keys in
position order and writes every key above u* and the first keys equal to it, until k are written, as positions
or as cache slots through the page table, then -1 to the row's end. `indexer_topk_kernel`: one program per row.
The split form spreads a row over programs of `span` keys: a launch per pass adds each span's histogram into the
row's, then one counts each span's keys above / equal to u*, and one writes each span at its offset."""

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
def _span_hist(row, lo, hi, prefix, P: tl.constexpr, BLOCK: tl.constexpr):
    """512 bins: counts of pass P's 8-bit digit among keys lo <= s < hi whose higher digits equal `prefix`
    (bins 256.. hold the rest)."""
    offs = tl.arange(0, BLOCK)
    shift: tl.constexpr = 24 - 8 * P
    hist = tl.zeros((512,), dtype=tl.int32)
    for s0 in range(lo, hi, BLOCK):
        s = s0 + offs
        m = s < hi
        u = _ordered(tl.load(row + s, mask=m, other=0.0))
        if P > 0:
            m = m & ((u >> (shift + 8)) == prefix)
        digit = ((u >> shift) & 0xFF).to(tl.int32)
        hist += tl.histogram(tl.where(m, digit, 256), 512)
    return hist


@triton.jit
def _narrow(hist, prefix, need):
    """One pass's step: the digit d holding the need-th largest key (hist: 512 bins, bins 256.. ignored) ->
    (prefix << 8 | d, need less the keys of larger digits)."""
    bins = tl.arange(0, 512)
    hist = tl.where(bins < 256, hist, 0)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # keys of this prefix with a larger digit
    d = tl.min(tl.where(above < need, bins, 512), 0)
    need -= tl.sum(tl.where(bins > d, hist, 0), 0)
    return (prefix << 8) | d.to(tl.uint32), need


@triton.jit
def _write_span(
    row,
    out_row,
    lo,
    hi,
    prefix,
    need,
    written,
    ties,
    pt_row,
    page_size,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the selected keys lo <= s < hi (above u* = prefix, or equal to it with tie rank <= need) at
    out_row[written ..], in position order; `ties`: keys equal to u* before lo."""
    offs = tl.arange(0, BLOCK)
    for s0 in range(lo, hi, BLOCK):
        s = s0 + offs
        m = s < hi
        u = _ordered(tl.load(row + s, mask=m, other=0.0))
        eq = m & (u == prefix)
        rank = ties + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among keys equal to u*
        sel = (m & (u > prefix)) | (eq & (rank <= need))
        at = written + tl.cumsum(sel.to(tl.int32), 0) - 1
        if SLOTS:
            page = tl.load(pt_row + s // page_size, mask=sel, other=0).to(tl.int64)
            val = (page * page_size + s % page_size).to(tl.int32)
        else:
            val = s
        tl.store(out_row + at, val, mask=sel)
        written += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _pad_row(out_row, len_ptr, take, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """-1 after the row's `take` keys, and its length."""
    offs = tl.arange(0, BLOCK)
    for j0 in range(0, TOPK, BLOCK):
        j = j0 + offs
        tl.store(out_row + j, tl.full((BLOCK,), -1, tl.int32), mask=(j >= take) & (j < TOPK))
    tl.store(len_ptr, take)


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
    # u* and how many keys equal to it are taken (all keys when there are at most K)
    prefix = tl.zeros((), dtype=tl.uint32)
    need = take  # with at most K keys, u* = 0 is below every key: all are taken
    if n > K:
        for p in tl.static_range(4):
            prefix, need = _narrow(_span_hist(row, 0, n, prefix, p, BLOCK), prefix, need)
    pt_row = pt_ptr + tl.load(req_ptr + t).to(tl.int64) * pt_stride
    zero = tl.zeros((), dtype=tl.int32)
    out_row = out_ptr + t * out_stride
    _write_span(row, out_row, 0, n, prefix, need, zero, zero, pt_row, page_size, SLOTS, BLOCK)
    _pad_row(out_row, len_ptr + t, take, TOPK, BLOCK)


@triton.jit
def _row_state(hist_row, n, K, P: tl.constexpr):
    """(u* prefix, need) after the row's first P passes, from its summed histograms hist_row [4, 256]; rows
    of at most K keys take every key (prefix 0, need n)."""
    prefix = tl.zeros((), dtype=tl.uint32)
    need = tl.minimum(n, K)
    if n > K:
        bins = tl.arange(0, 512)
        for p in tl.static_range(P):
            hist = tl.load(hist_row + p * 256 + bins, mask=bins < 256, other=0)
            prefix, need = _narrow(hist, prefix, need)
    return prefix, need


@triton.jit
def topk_hist_kernel(
    lg_ptr, lg_stride, pos_ptr, hist_ptr, width, K, span, P: tl.constexpr, BLOCK: tl.constexpr
):
    """Pass P of the split select: grid (rows, spans); adds the span's digit histogram into hist [rows, 4, 256]."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, n)
    if (n > K) & (lo < hi):
        hist_row = hist_ptr + t * 1024
        prefix, _need = _row_state(hist_row, n, K, P)
        hist = _span_hist(lg_ptr + t * lg_stride, lo, hi, prefix, P, BLOCK)
        bins = tl.arange(0, 512)
        tl.atomic_add(hist_row + P * 256 + bins, hist, mask=bins < 256, sem="relaxed")


@triton.jit
def topk_count_kernel(lg_ptr, lg_stride, pos_ptr, hist_ptr, cnt_ptr, width, K, span, BLOCK: tl.constexpr):
    """Grid (rows, spans): keys of each span above u* and equal to it -> cnt [rows, spans, 2]."""
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)
    prefix, _need = _row_state(hist_ptr + t * 1024, n, K, 4)
    lo = sp * span
    hi = tl.minimum(lo + span, n)
    row = lg_ptr + t * lg_stride
    offs = tl.arange(0, BLOCK)
    gt = tl.zeros((), dtype=tl.int32)
    eq = tl.zeros((), dtype=tl.int32)
    for s0 in range(lo, hi, BLOCK):
        s = s0 + offs
        m = s < hi
        u = _ordered(tl.load(row + s, mask=m, other=0.0))
        gt += tl.sum((m & (u > prefix)).to(tl.int32), 0)
        eq += tl.sum((m & (u == prefix)).to(tl.int32), 0)
    c = cnt_ptr + (t * tl.num_programs(1) + sp) * 2
    tl.store(c, gt)
    tl.store(c + 1, eq)


@triton.jit
def topk_write_kernel(
    lg_ptr,
    lg_stride,
    pos_ptr,
    req_ptr,
    pt_ptr,
    pt_stride,
    hist_ptr,
    cnt_ptr,
    out_ptr,
    out_stride,
    len_ptr,
    width,
    page_size,
    K,
    span,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    NSP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (rows, spans): each span's selected keys at its offset (the spans before it: their keys above u*,
    and their keys equal to it up to `need`); span 0 also pads the row and writes its length."""
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, width)
    prefix, need = _row_state(hist_ptr + t * 1024, n, K, 4)
    j = tl.arange(0, NSP)
    before = j < sp
    c = cnt_ptr + t * tl.num_programs(1) * 2 + j * 2
    gt = tl.sum(tl.load(c, mask=before, other=0), 0)
    ties = tl.sum(tl.load(c + 1, mask=before, other=0), 0)
    lo = sp * span
    hi = tl.minimum(lo + span, n)
    pt_row = pt_ptr + tl.load(req_ptr + t).to(tl.int64) * pt_stride
    out_row = out_ptr + t * out_stride
    _write_span(
        lg_ptr + t * lg_stride,
        out_row,
        lo,
        hi,
        prefix,
        need,
        gt + tl.minimum(ties, need),
        ties,
        pt_row,
        page_size,
        SLOTS,
        BLOCK,
    )
    if sp == 0:
        _pad_row(out_row, len_ptr + t, tl.minimum(n, K), TOPK, BLOCK)
