"""Triton body of kernels/indexer.py: lightning-indexer logits over the paged indexer-key pool. Key and query
rows of DI values are held at DI_P columns (a power of two); the padding columns read 0. One program scores one
query row (decode) or ROWS rows (extend; their heads are the dot's rows) against one span of keys, BN per step:
two compile-time variants with the same logits (`EXTEND`, see the kernel)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, load_main, token_rows


@triton.jit
def _key_tile(
    pt_ptr,
    pt_stride,
    req,
    s,
    valid,
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
    DT: tl.constexpr,
):
    """Keys [BN, DI_P] (DT; fp8 values unscaled) of positions s of request `req`, and each key's scale [BN] (1
    for a bf16 pool): the extend variant applies the scale after the head sum."""
    d = tl.arange(0, DI_P)
    page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=valid, other=0).to(tl.int64)
    row, srow = token_rows(
        page * page_size + s % page_size, page_size, page_bytes, data_stride, scale_base, scale_stride
    )
    m = cols(valid[:, None], d, DI, DI_P)
    if KIND == 0:
        k = tl.load(bf_ptr + (row[:, None] + 2 * d[None, :]) // 2, mask=m, other=0.0).to(DT)
        ksc = tl.full(s.shape, 1.0, tl.float32)
    else:
        k = tl.load(f8_ptr + row[:, None] + d[None, :], mask=m, other=0.0).to(DT)
        ksc = tl.load(f32_ptr + srow // 4, mask=valid, other=1.0)
    return k, ksc


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
    T,
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
    ROWS: tl.constexpr,
):
    """Each variant is the faster where serving launches it (benchmarks/bench_indexer.py, docs/benchmarks.md):
    decode (EXTEND off, one row per program) dequantises the key tile as it reads it (`load_main`). Extend
    (EXTEND on) scores ROWS consecutive query rows per program: when they are one request's (all but the
    programs that straddle two requests), each key tile is read once for all of them, one dot of ROWS x heads
    rows. It multiplies the fp8 key's one power-of-two scale per token into the head sum instead of every key
    value, which the logit's positive homogeneity in the key allows exactly (ReLU(q . c k) = c ReLU(q . k),
    c > 0), and skips key tiles wholly past the rows' positions (writing -inf)."""
    sp = tl.program_id(1)
    d = tl.arange(0, DI_P)
    lo = sp * keys_per_prog
    if EXTEND:
        t0 = tl.program_id(0).to(tl.int64) * ROWS
        r = tl.arange(0, ROWS)
        rin = t0 + r < T
        # row m of the dot is head m % BNI of query row m // BNI
        mr = tl.arange(0, ROWS * BNI) // BNI
        mh = tl.arange(0, ROWS * BNI) % BNI
        mm = (t0 + mr < T) & (mh < NI)
        q = tl.load(
            q_ptr + (t0 + mr)[:, None] * q_stride_t + mh[:, None] * q_stride_h + d[None, :],
            mask=cols(mm[:, None], d, DI, DI_P),
            other=0.0,
        ).to(DT)
        w = tl.load(w_ptr + (t0 + mr) * w_stride_t + mh, mask=mm, other=0.0)
        req = tl.load(req_ptr + t0 + r, mask=rin, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + t0 + r, mask=rin, other=-1).to(tl.int64)
        req0 = tl.load(req_ptr + t0).to(tl.int64)
        one = tl.sum(tl.where(rin & (req != req0), 1, 0)) == 0
        top = tl.max(pos)
        for n0 in range(lo, lo + keys_per_prog, BN):
            s = n0 + tl.arange(0, BN)
            inb = s < max_len
            live = (s[None, :] <= pos[:, None]) & inb[None, :]
            if n0 <= top:
                if one:
                    k, ksc = _key_tile(
                        pt_ptr,
                        pt_stride,
                        req0,
                        s,
                        inb & (s <= top),
                        f8_ptr,
                        bf_ptr,
                        f32_ptr,
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
                    x = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0) * w[:, None]
                    logit = tl.sum(tl.reshape(x, (ROWS, BNI, BN)), 1) * ksc[None, :]
                else:
                    logit = tl.zeros((ROWS, BN), tl.float32)
                    for j in tl.static_range(ROWS):
                        if t0 + j < T:
                            rj = tl.load(req_ptr + t0 + j).to(tl.int64)
                            pj = tl.load(pos_ptr + t0 + j).to(tl.int64)
                            k, ksc = _key_tile(
                                pt_ptr,
                                pt_stride,
                                rj,
                                s,
                                inb & (s <= pj),
                                f8_ptr,
                                bf_ptr,
                                f32_ptr,
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
                            x = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0) * w[:, None]
                            x = tl.where((mr == j)[:, None], x, 0.0)
                            logit += tl.sum(tl.reshape(x, (ROWS, BNI, BN)), 1) * ksc[None, :]
                logit = tl.where(live, logit, float("-inf"))
            else:
                logit = tl.full((ROWS, BN), float("-inf"), tl.float32)
            tl.store(
                out_ptr + (t0 + r)[:, None] * out_stride + s[None, :], logit, mask=rin[:, None] & inb[None, :]
            )
    else:
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BNI)
        hm = h < NI
        q = tl.load(
            q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
            mask=cols(hm[:, None], d, DI, DI_P),
            other=0.0,
        ).to(DT)
        w = tl.load(w_ptr + t * w_stride_t + h, mask=hm, other=0.0)
        req = tl.load(req_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        for n0 in range(lo, lo + keys_per_prog, BN):
            s = n0 + tl.arange(0, BN)
            inb = s < max_len
            valid = inb & (s <= pos)
            page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=valid, other=0).to(tl.int64)
            slots = page * page_size + s % page_size
            row, srow = token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride)
            k = load_main(
                u8_ptr, f8_ptr, bf_ptr, f32_ptr, row, srow, valid, KIND, DI, DI_P, NOPE, TILE, BN, DT
            )
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            sc = tl.maximum(sc, 0.0) * w[:, None]
            logit = tl.sum(sc, 0)
            logit = tl.where(valid, logit, float("-inf"))
            tl.store(out_ptr + t * out_stride + s, logit, mask=inb)
