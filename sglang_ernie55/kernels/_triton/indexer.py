"""Triton body of kernels/indexer.py: lightning-indexer logits over the paged indexer-key pool. Key and query
rows of DI values are held at DI_P columns (a power of two); the padding columns read 0.

One program scores one query row against one span of keys: the row's heads are the dot's rows, BN keys its
columns. Two compile-time variants, each the faster where serving uses it (benchmarks/bench_indexer.py for
extend rows, the decode table of docs/benchmarks.md):
- decode (EXTEND off): the key tile is dequantised as it is read (`load_main`);
- extend (EXTEND on): the fp8 key has one power-of-two scale per token and the logit is positively homogeneous
  in the key (ReLU(q . c k) = c ReLU(q . k) for c > 0), so the scale multiplies the head sum of BN logits
  instead of every key value (the same floats); key tiles wholly past the row's position are not read, only
  written -inf (an extend chunk's rows share one width, most of them shorter)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, load_main, token_rows


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
):
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
                page = tl.load(pt_ptr + req * pt_stride + s // page_size, mask=valid, other=0).to(tl.int64)
                slots = page * page_size + s % page_size
                row, srow = token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride)
                m = cols(valid[:, None], d, DI, DI_P)
                if KIND == 0:
                    k = tl.load(bf_ptr + (row[:, None] + 2 * d[None, :]) // 2, mask=m, other=0.0).to(DT)
                else:
                    k = tl.load(f8_ptr + row[:, None] + d[None, :], mask=m, other=0.0).to(DT)
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
                logit = tl.sum(tl.maximum(sc, 0.0) * w[:, None], 0)
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
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            sc = tl.maximum(sc, 0.0) * w[:, None]
            logit = tl.sum(sc, 0)
            logit = tl.where(valid, logit, float("-inf"))
        tl.store(out_ptr + t * out_stride + s, logit, mask=inb)
