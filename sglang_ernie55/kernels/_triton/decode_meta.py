"""One program per request: every index row `KernelPath.fixed_meta` builds for a fixed-shape batch (decode,
target verify), in one launch in place of ~80 small torch ops. See kernels/decode_meta.py."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_meta_kernel(
    req_ptr,  # [B] request slots
    seq_ptr,  # [B] SGLang's sequence lengths (+ SEQ_ADD: the lengths after the batch)
    loc_ptr,  # [B * PER_REQ] full-pool slots of the new tokens, request-major
    r2t_ptr,  # req_to_token [slots, r2t_width]
    r2t_stride,
    r2t_width,
    map_ptr,  # full -> window slot mapping (HAS_MAP)
    tok_req_ptr,
    tok_pos_ptr,
    win_loc_ptr,
    pt_ptr,  # [B, n_pages] int32
    n_pages,
    widx_ptr,  # [T, W] int32
    wlen_ptr,
    cidx_ptr,  # [T, cmp_width] int32
    cmp_width,
    clen_ptr,
    job_req_ptr,  # five [B * NJ] int32
    job_blk_ptr,
    job_p_ptr,
    job_start_ptr,
    job_out_ptr,
    st_req_ptr,
    st_seq_ptr,
    SEQ_ADD: tl.constexpr,
    PER_REQ: tl.constexpr,
    NJ: tl.constexpr,
    W: tl.constexpr,
    W_P: tl.constexpr,  # W's register width (a power of two)
    RATIO: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.load(req_ptr + b).to(tl.int64)
    L = tl.load(seq_ptr + b).to(tl.int64) + SEQ_ADD
    P = L - PER_REQ
    row = r2t_ptr + r * r2t_stride
    # the page table: full-pool page of each page start of the request
    for p0 in range(0, n_pages, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        v = tl.load(row + i.to(tl.int64) * PAGE, mask=i < n_pages, other=0)
        tl.store(pt_ptr + b.to(tl.int64) * n_pages + i, (v // PAGE).to(tl.int32), mask=i < n_pages)
    # padded CUDA-graph rows point into SGLang's padding page: no state row, no compression job
    valid_req = tl.load(loc_ptr + b.to(tl.int64) * PER_REQ) >= PAGE
    for k in range(0, PER_REQ):
        t = b.to(tl.int64) * PER_REQ + k
        pos = P + k
        loc = tl.load(loc_ptr + t).to(tl.int64)
        tl.store(tok_req_ptr + t, b.to(tl.int32))
        tl.store(tok_pos_ptr + t, pos.to(tl.int32))
        if HAS_MAP:
            wl = tl.where(loc >= 0, tl.load(map_ptr + tl.maximum(loc, 0)).to(tl.int64), loc)
        else:
            wl = loc
        tl.store(win_loc_ptr + t, wl)
        tl.store(st_req_ptr + t, tl.where(loc >= PAGE, r, -1).to(tl.int32))
        tl.store(st_seq_ptr + t, L.to(tl.int32))
        # window: positions max(0, pos - W + 1) .. pos, oldest first, -1 after the row's length
        wlen = tl.minimum(pos + 1, W)
        kk = tl.arange(0, W_P)
        s = pos - wlen + 1 + kk
        okw = kk < wlen
        sc = tl.where(okw, s, 0)
        pg = tl.load(row + (sc // PAGE) * PAGE, mask=okw, other=0).to(tl.int64) // PAGE
        full = tl.where(okw, pg * PAGE + sc % PAGE, -1)
        if HAS_MAP:
            full = tl.where(
                full >= 0, tl.load(map_ptr + tl.maximum(full, 0), mask=okw, other=0).to(tl.int64), -1
            )
        tl.store(widx_ptr + t * W + kk, full.to(tl.int32), mask=kk < W)
        tl.store(wlen_ptr + t, wlen.to(tl.int32))
        # compressed entries j < (pos + 1) // RATIO: block j's slot is full_slot(RATIO j) // RATIO
        clen = (pos + 1) // RATIO
        tl.store(clen_ptr + t, clen.to(tl.int32))
        for c0 in range(0, cmp_width, BLOCK_C):
            j = c0 + tl.arange(0, BLOCK_C)
            okc = j < clen
            jc = tl.where(okc, j, 0).to(tl.int64)
            cp = tl.load(row + (jc // (PAGE // RATIO)) * PAGE, mask=okc, other=0).to(tl.int64) // PAGE
            v = tl.where(okc, cp * (PAGE // RATIO) + jc % (PAGE // RATIO), -1)
            tl.store(cidx_ptr + t * cmp_width + j, v.to(tl.int32), mask=j < cmp_width)
    # compression jobs: blocks P // RATIO + q that complete within (P, L]
    for q in tl.static_range(NJ):
        blk = P // RATIO + q
        ok = ((blk + 1) * RATIO <= L) & valid_req
        first = tl.minimum(blk * RATIO, r2t_width - 1)
        slot = tl.load(row + tl.maximum(first, 0), mask=ok, other=0).to(tl.int64)
        o = b.to(tl.int64) * NJ + q
        tl.store(job_req_ptr + o, r.to(tl.int32))
        tl.store(job_blk_ptr + o, blk.to(tl.int32))
        tl.store(job_p_ptr + o, P.to(tl.int32))
        tl.store(job_start_ptr + o, (b * PER_REQ).to(tl.int32))
        tl.store(job_out_ptr + o, tl.where(ok, slot // RATIO, -1).to(tl.int32))
