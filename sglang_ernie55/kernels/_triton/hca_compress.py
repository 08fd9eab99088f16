"""Triton bodies of kernels/hca_compress.py: block compression into the compressed pool and the open-block
state update. A block is RATIO rows (a power of two); channels are held at padded widths (HALF_P pairs, W_P
values: powers of two), the columns past the real width masked (read as 0, never stored).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, encode_store, token_rows, within


@triton.jit
def hca_compress_kernel(
    kvs_ptr,
    kvs_stride,
    state_ptr,
    state_stride_r,
    state_stride_t,
    ape_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    cs_stride,
    job_slot_ptr,
    job_block_ptr,
    job_start_ptr,
    job_tok_ptr,
    job_out_ptr,
    eps,
    ring,
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    page_size,
    page_bytes,
    data_stride,
    scale_base,
    scale_stride,
    D: tl.constexpr,
    HALF_P: tl.constexpr,
    ROPE: tl.constexpr,
    RATIO: tl.constexpr,
    RB: tl.constexpr,
    KIND: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """One program per job (one complete block). Channels are handled as even / odd halves so the
    interleaved RoPE pairs (2i, 2i+1) sit in the same lane (D / 2 pairs held as HALF_P lanes). State rows of
    block j: ring rows (RATIO * j) % ring + t (ring = RATIO or 2 * RATIO rows per request slot)."""
    jb = tl.program_id(0)
    out_slot = tl.load(job_out_ptr + jb).to(tl.int64)
    if out_slot < 0:
        return
    rslot = tl.load(job_slot_ptr + jb).to(tl.int64)
    blk = tl.load(job_block_ptr + jb).to(tl.int64)
    ext_start = tl.load(job_start_ptr + jb).to(tl.int64)
    tok0 = tl.load(job_tok_ptr + jb).to(tl.int64)
    ring_base = (blk * RATIO) % ring
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF_P)
    ce = 2 * i
    m_e = tl.full([HALF_P], float("-inf"), tl.float32)
    m_o = tl.full([HALF_P], float("-inf"), tl.float32)
    l_e = tl.zeros([HALF_P], tl.float32)
    l_o = tl.zeros([HALF_P], tl.float32)
    a_e = tl.zeros([HALF_P], tl.float32)
    a_o = tl.zeros([HALF_P], tl.float32)
    for r0 in range(0, RATIO, RB):
        r = r0 + tl.arange(0, RB)
        pos = blk * RATIO + r
        new = pos >= ext_start
        nrow = kvs_ptr + (tok0 + pos - ext_start)[:, None] * kvs_stride
        srow = state_ptr + rslot * state_stride_r + (ring_base + r[:, None]).to(tl.int64) * state_stride_t
        # padded lanes (i >= HALF) read 0: weight 1 / RATIO each, value 0, so their entry is 0
        mn = cols(new[:, None], i, HALF, HALF_P)
        ms = cols((~new)[:, None], i, HALF, HALF_P)
        # new rows in the layer's dtype (fp32 / bf16 / fp16), read as fp32; state rows fp32
        c_e = tl.load(nrow + ce[None, :], mask=mn, other=0.0).to(tl.float32) + tl.load(
            srow + ce[None, :], mask=ms, other=0.0
        )
        c_o = tl.load(nrow + ce[None, :] + 1, mask=mn, other=0.0).to(tl.float32) + tl.load(
            srow + ce[None, :] + 1, mask=ms, other=0.0
        )
        s_e = tl.load(nrow + D + ce[None, :], mask=mn, other=0.0).to(tl.float32) + tl.load(
            srow + D + ce[None, :], mask=ms, other=0.0
        )
        s_o = tl.load(nrow + D + ce[None, :] + 1, mask=mn, other=0.0).to(tl.float32) + tl.load(
            srow + D + ce[None, :] + 1, mask=ms, other=0.0
        )
        if HALF_P > HALF:
            s_e += tl.load(ape_ptr + r[:, None] * D + ce[None, :], mask=(i < HALF)[None, :], other=0.0)
            s_o += tl.load(ape_ptr + r[:, None] * D + ce[None, :] + 1, mask=(i < HALF)[None, :], other=0.0)
        else:
            s_e += tl.load(ape_ptr + r[:, None] * D + ce[None, :])
            s_o += tl.load(ape_ptr + r[:, None] * D + ce[None, :] + 1)
        nm_e = tl.maximum(m_e, tl.max(s_e, 0))
        nm_o = tl.maximum(m_o, tl.max(s_o, 0))
        p_e = tl.exp(s_e - nm_e[None, :])
        p_o = tl.exp(s_o - nm_o[None, :])
        al_e = tl.exp(m_e - nm_e)
        al_o = tl.exp(m_o - nm_o)
        l_e = l_e * al_e + tl.sum(p_e, 0)
        l_o = l_o * al_o + tl.sum(p_o, 0)
        a_e = a_e * al_e + tl.sum(p_e * c_e, 0)
        a_o = a_o * al_o + tl.sum(p_o * c_o, 0)
        m_e = nm_e
        m_o = nm_o
    y_e = a_e / l_e
    y_o = a_o / l_o
    rms = tl.rsqrt((tl.sum(y_e * y_e, 0) + tl.sum(y_o * y_o, 0)) / D + eps)
    if HALF_P > HALF:
        y_e = y_e * rms * tl.load(w_ptr + ce, mask=i < HALF, other=0.0)
        y_o = y_o * rms * tl.load(w_ptr + ce + 1, mask=i < HALF, other=0.0)
    else:
        y_e = y_e * rms * tl.load(w_ptr + ce)
        y_o = y_o * rms * tl.load(w_ptr + ce + 1)
    R0: tl.constexpr = (D - ROPE) // 2
    is_r = within(i >= R0, i, HALF, HALF_P)
    k = tl.where(is_r, i - R0, 0)
    cpos = blk * RATIO
    cs = tl.load(cos_ptr + cpos * cs_stride + k, mask=is_r, other=1.0)
    sn = tl.load(sin_ptr + cpos * cs_stride + k, mask=is_r, other=0.0)
    z_e = y_e * cs - y_o * sn
    z_o = y_e * sn + y_o * cs
    x = tl.reshape(tl.join(z_e, z_o), (2 * HALF_P,))
    row, srow2 = token_rows(out_slot, page_size, page_bytes, data_stride, scale_base, scale_stride)
    encode_store(x, row, srow2, u8_ptr, f8_ptr, bf_ptr, f32_ptr, KIND, D, 2 * HALF_P, NOPE, TILE, SCALE_BYTES)


@triton.jit
def hca_state_update_kernel(
    kvs_ptr,
    kvs_stride,
    state_ptr,
    state_stride_r,
    state_stride_t,
    pos_ptr,
    slot_ptr,
    seqlen_ptr,
    W: tl.constexpr,
    W_P: tl.constexpr,
    RATIO: tl.constexpr,
    RING: tl.constexpr,
):
    """Token i's row into ring row p % RING when its block is one of the last RING // RATIO blocks."""
    i = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + i).to(tl.int64)
    L = tl.load(seqlen_ptr + i).to(tl.int64)
    rs = tl.load(slot_ptr + i).to(tl.int64)
    if (p < (L // RATIO - (RING // RATIO - 1)) * RATIO) | (rs < 0):
        return
    c = tl.arange(0, W_P)
    if W_P > W:
        v = tl.load(kvs_ptr + i * kvs_stride + c, mask=c < W).to(tl.float32)
        tl.store(state_ptr + rs * state_stride_r + (p % RING) * state_stride_t + c, v, mask=c < W)
    else:
        v = tl.load(kvs_ptr + i * kvs_stride + c).to(tl.float32)
        tl.store(state_ptr + rs * state_stride_r + (p % RING) * state_stride_t + c, v)
