"""Triton body of kernels/indexer.py: lightning-indexer logits over the paged indexer-key pool. Key and query
rows of DI values are held at DI_P columns (a power of two); the padding columns read 0. One program scores one
query row (its heads: the dot's rows) against one span of keys, BN per step, in two compile-time variants with
the same logits (`EXTEND`, see the kernel); `indexer_logits_rows_kernel` scores ROWS query rows of one request
against each key tile it reads."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, load_main, token_rows


@triton.jit
def _head_sum(q, k, w, KM: tl.constexpr):
    """sum_h w[h] ReLU(q[h] . k[n]) for the BN keys k [BN, D] and the heads q [BNI, D]: heads on the dot's M
    side and a sum across its rows, or with KM (keys major) keys on the M side and the sum along each
    accumulator row."""
    if KM:
        return tl.sum(tl.maximum(tl.dot(k, tl.trans(q), input_precision="ieee"), 0.0) * w[None, :], 1)
    return tl.sum(tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0) * w[:, None], 0)


@triton.jit
def _raw_keys(
    pt_ptr,
    pt_stride,
    req,
    s,
    valid,
    d,
    f8_ptr,
    bf_ptr,
    page_size,
    page_bytes,
    data_stride,
    scale_base,
    scale_stride,
    KIND: tl.constexpr,
    DI: tl.constexpr,
    DI_P: tl.constexpr,
    DT: tl.constexpr,
):
    """The keys at positions s [BN] of request `req` as stored ([BN, DI_P], fp8 values unscaled), and the byte
    offsets of their scale rows (one fp32 power of two per fp8 token: the caller scales each key's logit)."""
    page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=valid, other=0).to(tl.int64)
    slots = page * page_size + s % page_size
    row, srow = token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride)
    m = cols(valid[:, None], d, DI, DI_P)
    if KIND == 0:
        k = tl.load(bf_ptr + (row[:, None] + 2 * d[None, :]) // 2, mask=m, other=0.0).to(DT)
    else:
        k = tl.load(f8_ptr + row[:, None] + d[None, :], mask=m, other=0.0).to(DT)
    return k, srow


@triton.jit
def _rows_head_sums(q, k, w, KM: tl.constexpr, ROWS: tl.constexpr, BNI: tl.constexpr, BN: tl.constexpr):
    """[ROWS, BN]: `_head_sum` of each of ROWS query rows, whose heads are q [ROWS * BNI, D] (row r's head h
    at r * BNI + h) and w [ROWS * BNI], over the BN keys k [BN, D]: one dot for all rows."""
    if KM:
        x = tl.maximum(tl.dot(k, tl.trans(q), input_precision="ieee"), 0.0) * w[None, :]
        return tl.trans(tl.sum(tl.reshape(x, (BN, ROWS, BNI)), 2))
    x = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0) * w[:, None]
    return tl.sum(tl.reshape(x, (ROWS, BNI, BN)), 1)


@triton.jit
def indexer_logits_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    w_ptr,
    w_stride_t,
    pt_ptr,
    pt_stride,
    req_ptr,
    pos_ptr,
    out_ptr,
    out_stride,
    max_len,
    keys_per_prog,
    NI,
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
    DI: tl.constexpr,
    DI_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    BNI: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
    EXTEND: tl.constexpr,
    KM: tl.constexpr,
):
    """Each variant is the faster where serving launches it (benchmarks/bench_indexer.py, docs/benchmarks.md):
    decode (EXTEND off) dequantises the key tile as it reads it (`load_main`). Extend (EXTEND on) multiplies the
    fp8 key's one power-of-two scale per token into the head sum of BN logits instead of every key value, which
    the logit's positive homogeneity in the key allows exactly (ReLU(q . c k) = c ReLU(q . k), c > 0), and skips
    key tiles wholly past the row's position (writing -inf): an extend chunk's rows share one width, most of
    them shorter."""
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    h = tl.arange(0, BNI)
    hm = h < NI
    d = tl.arange(0, DI_P)
    q = tl.load(
        q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
        mask=cols(hm[:, None], d, DI, DI_P),
        other=0.0,
    ).to(DT)
    w = tl.load(w_ptr + t * w_stride_t + h, mask=hm, other=0.0)
    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    lo = sp * keys_per_prog
    for n0 in range(lo, lo + keys_per_prog, BN):
        s = n0 + tl.arange(0, BN)
        inb = s < max_len
        valid = inb & (s <= pos)
        if EXTEND:
            if n0 <= pos:
                k, srow = _raw_keys(
                    pt_ptr,
                    pt_stride,
                    req,
                    s,
                    valid,
                    d,
                    f8_ptr,
                    bf_ptr,
                    page_size,
                    page_bytes,
                    data_stride,
                    scale_base,
                    scale_stride,
                    KIND,
                    DI,
                    DI_P,
                    DT,
                )
                logit = _head_sum(q, k, w, KM)
                if KIND != 0:
                    logit = logit * tl.load(f32_ptr + srow // 4, mask=valid, other=1.0)
                logit = tl.where(valid, logit, float("-inf"))
            else:
                logit = tl.full((BN,), float("-inf"), tl.float32)
        else:
            page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=valid, other=0).to(tl.int64)
            slots = page * page_size + s % page_size
            row, srow = token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride)
            k = load_main(
                u8_ptr, f8_ptr, bf_ptr, f32_ptr, row, srow, valid, KIND, DI, DI_P, NOPE, TILE, BN, DT
            )
            logit = _head_sum(q, k, w, KM)
            logit = tl.where(valid, logit, float("-inf"))
        tl.store(out_ptr + t * out_stride + s, logit, mask=inb)


@triton.jit
def indexer_logits_rows_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    w_ptr,
    w_stride_t,
    pt_ptr,
    pt_stride,
    req_ptr,
    pos_ptr,
    out_ptr,
    out_stride,
    max_len,
    keys_per_prog,
    NI,
    T,
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
    DI: tl.constexpr,
    DI_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    BNI: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
    KM: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The extend variant for query rows ROWS at a time: rows t0 .. t0 + ROWS - 1 of one request read each key
    tile once, in one dot with ROWS x the heads, where one row per program reads it ROWS times (from L2).
    Key tiles past the group's last position are skipped (-inf). A group that spans two requests (an extend
    batch's rows are grouped by request, so only at a boundary) runs one pass per row, the others masked."""
    g = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    t0 = g * ROWS
    rr = tl.arange(0, ROWS)
    tr = t0 + rr
    tm = tr < T
    hh = tl.arange(0, ROWS * BNI)
    hr = t0 + hh // BNI
    h = hh % BNI
    hm = (h < NI) & (hr < T)
    d = tl.arange(0, DI_P)
    q = tl.load(
        q_ptr + hr[:, None] * q_stride_t + h[:, None] * q_stride_h + d[None, :],
        mask=cols(hm[:, None], d, DI, DI_P),
        other=0.0,
    ).to(DT)
    w = tl.load(w_ptr + hr * w_stride_t + h, mask=hm, other=0.0)
    req0 = tl.load(req_ptr + t0).to(tl.int64)
    reqs = tl.load(req_ptr + tr, mask=tm, other=0).to(tl.int64)
    mixed = tl.max(tl.where(tm & (reqs != req0), 1, 0), 0)
    poss = tl.load(pos_ptr + tr, mask=tm, other=-1).to(tl.int64)
    lo = sp * keys_per_prog
    for p in range(ROWS):
        if (p == 0) | (mixed != 0):
            act = tm & ((mixed == 0) | (rr == p))
            req = tl.max(tl.where(act, reqs, 0), 0)
            pos = tl.where(act, poss, -1)
            top = tl.max(pos, 0)
            for n0 in range(lo, lo + keys_per_prog, BN):
                s = n0 + tl.arange(0, BN)
                inb = s < max_len
                if n0 <= top:
                    valid = inb & (s <= top)
                    k, srow = _raw_keys(
                        pt_ptr,
                        pt_stride,
                        req,
                        s,
                        valid,
                        d,
                        f8_ptr,
                        bf_ptr,
                        page_size,
                        page_bytes,
                        data_stride,
                        scale_base,
                        scale_stride,
                        KIND,
                        DI,
                        DI_P,
                        DT,
                    )
                    logit = _rows_head_sums(q, k, w, KM, ROWS, BNI, BN)
                    if KIND != 0:
                        logit = logit * tl.load(f32_ptr + srow // 4, mask=valid, other=1.0)[None, :]
                    logit = tl.where(s[None, :] <= pos[:, None], logit, float("-inf"))
                else:
                    logit = tl.full((ROWS, BN), float("-inf"), tl.float32)
                tl.store(
                    out_ptr + tr[:, None] * out_stride + s[None, :], logit, mask=act[:, None] & inb[None, :]
                )
