"""Triton bodies of kernels/sparse_attn.py: gather + dequant + one-softmax MQA over up to two paged scopes,
split over keys, then a combine pass that adds the per-head sink.

Split grid: (head block, query t, key split), head blocks fastest so programs reading the same keys run
together; split s covers [s * chunk, (s + 1) * chunk) of [main[0:len_a] | extra[0:len_b]]. Softmax in base 2.
``DT``: bf16 dot operands on GPUs; fp32 for fp32 queries and under the interpreter (its bf16 dot is wrong).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, load_main, load_tail, token_rows


@triton.jit
def _attend_scope(
    m_i,
    l_i,
    acc,
    acc_t,
    q,
    q_t,
    idx_ptr,
    idx_stride,
    t,
    lo,
    hi,
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    page_size,
    page_bytes,
    data_stride,
    scale_base,
    scale_stride,
    qk_scale,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    TAIL_OFF: tl.constexpr,
    V_TAIL: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
):
    offs = tl.arange(0, BN)
    for n0 in range(lo, hi, BN):
        n = n0 + offs
        inb = n < hi
        slots = tl.load(idx_ptr + t * idx_stride + n, mask=inb, other=-1)
        valid = inb & (slots >= 0)
        row, srow = token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride)
        k = load_main(
            u8_ptr, f8_ptr, bf_ptr, f32_ptr, row, srow, valid, KIND, MAIN, MAIN_P, NOPE, TILE, BN, DT
        )
        # IEEE matters only for fp32 operands (exactness runs), where Triton's default is TF32
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if TAIL > 0:
            kt = load_tail(bf_ptr, row, valid, TAIL_OFF, TAIL, TAIL_P, DT)
            s += tl.dot(q_t, tl.trans(kt), input_precision="ieee")
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = p.to(DT)
        acc = acc * alpha[:, None] + tl.dot(pb, k, input_precision="ieee")
        if V_TAIL:
            acc_t = acc_t * alpha[:, None] + tl.dot(pb, kt, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc, acc_t


@triton.jit
def sparse_attn_split_kernel(
    q_ptr,
    q_stride_t,
    q_stride_h,
    H,
    chunk,
    # main scope
    ia_ptr,
    ia_stride,
    la_ptr,
    KA,
    a_u8,
    a_f8,
    a_bf,
    a_f32,
    a_ps,
    a_pb,
    a_ds,
    a_sb,
    a_ss,
    # extra scope
    ib_ptr,
    ib_stride,
    lb_ptr,
    KB,
    b_u8,
    b_f8,
    b_bf,
    b_f32,
    b_ps,
    b_pb,
    b_ds,
    b_sb,
    b_ss,
    sink_ptr,
    sm_scale,
    o_ptr,
    o_stride_t,
    o_stride_h,
    lse_ptr,
    part_ptr,
    plse_ptr,
    n_split,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    TAIL_OFF: tl.constexpr,
    V_TAIL: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_LA: tl.constexpr,
    HAS_LB: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINGLE: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
):
    hb = tl.program_id(0)  # head blocks of one query token launch next to each other (its keys stay in L2)
    t = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E

    h = hb * BH + tl.arange(0, BH)
    hmask = h < H
    d = tl.arange(0, MAIN_P)
    q = tl.load(
        q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
        mask=cols(hmask[:, None], d, MAIN, MAIN_P),
        other=0.0,
    )
    q = q.to(DT)
    if TAIL > 0:
        dt = tl.arange(0, TAIL_P)
        q_t = tl.load(
            q_ptr + t * q_stride_t + h[:, None] * q_stride_h + MAIN + dt[None, :],
            mask=cols(hmask[:, None], dt, TAIL, TAIL_P),
            other=0.0,
        ).to(DT)
    else:
        q_t = q

    len_a = KA
    if HAS_LA:
        len_a = tl.minimum(tl.load(la_ptr + t), KA)
    len_b = 0
    if HAS_B:
        len_b = KB
        if HAS_LB:
            len_b = tl.minimum(tl.load(lb_ptr + t), KB)

    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, MAIN_P], tl.float32)
    if V_TAIL:
        acc_t = tl.zeros([BH, TAIL_P], tl.float32)
    else:
        acc_t = tl.zeros([BH, 1], tl.float32)

    start = sp * chunk
    end = start + chunk
    lo = start
    hi = tl.minimum(end, len_a)
    m_i, l_i, acc, acc_t = _attend_scope(
        m_i,
        l_i,
        acc,
        acc_t,
        q,
        q_t,
        ia_ptr,
        ia_stride,
        t,
        lo,
        hi,
        a_u8,
        a_f8,
        a_bf,
        a_f32,
        a_ps,
        a_pb,
        a_ds,
        a_sb,
        a_ss,
        qk_scale,
        KIND,
        MAIN,
        MAIN_P,
        NOPE,
        TILE,
        TAIL,
        TAIL_P,
        TAIL_OFF,
        V_TAIL,
        BN,
        DT,
    )
    if HAS_B:
        lo = tl.maximum(start - len_a, 0)
        hi = tl.minimum(end - len_a, len_b)
        m_i, l_i, acc, acc_t = _attend_scope(
            m_i,
            l_i,
            acc,
            acc_t,
            q,
            q_t,
            ib_ptr,
            ib_stride,
            t,
            lo,
            hi,
            b_u8,
            b_f8,
            b_bf,
            b_f32,
            b_ps,
            b_pb,
            b_ds,
            b_sb,
            b_ss,
            qk_scale,
            KIND,
            MAIN,
            MAIN_P,
            NOPE,
            TILE,
            TAIL,
            TAIL_P,
            TAIL_OFF,
            V_TAIL,
            BN,
            DT,
        )

    if SINGLE:
        denom = l_i
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        if HAS_SINK:
            sk = tl.load(sink_ptr + h, mask=hmask, other=0.0) * LOG2E
            m2 = tl.maximum(m_i, sk)
            denom = l_i * tl.exp2(m_safe - m2) + tl.exp2(sk - m2)
            acc = acc * tl.exp2(m_safe - m2)[:, None]
            if V_TAIL:
                acc_t = acc_t * tl.exp2(m_safe - m2)[:, None]
        denom = tl.where(denom == 0.0, 1.0, denom)
        optr = o_ptr + t * o_stride_t + h[:, None] * o_stride_h
        tl.store(
            optr + d[None, :],
            (acc / denom[:, None]).to(o_ptr.dtype.element_ty),
            mask=cols(hmask[:, None], d, MAIN, MAIN_P),
        )
        if V_TAIL:
            tl.store(
                optr + MAIN + dt[None, :],
                (acc_t / denom[:, None]).to(o_ptr.dtype.element_ty),
                mask=cols(hmask[:, None], dt, TAIL, TAIL_P),
            )
        lse = tl.where(l_i > 0, m_safe + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * H + h, lse, mask=hmask)
    else:
        DV: tl.constexpr = MAIN + TAIL if V_TAIL else MAIN
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        pbase = part_ptr + ((t * n_split + sp) * H + h[:, None]) * DV
        tl.store(pbase + d[None, :], acc / l_safe[:, None], mask=cols(hmask[:, None], d, MAIN, MAIN_P))
        if V_TAIL:
            tl.store(
                pbase + MAIN + dt[None, :],
                acc_t / l_safe[:, None],
                mask=cols(hmask[:, None], dt, TAIL, TAIL_P),
            )
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse = tl.where(l_i > 0, m_safe + tl.log2(l_safe), float("-inf"))
        tl.store(plse_ptr + (t * n_split + sp) * H + h, lse, mask=hmask)


@triton.jit
def sparse_attn_combine_kernel(
    part_ptr,
    plse_ptr,
    n_split,
    H,
    sink_ptr,
    o_ptr,
    o_stride_t,
    o_stride_h,
    lse_ptr,
    DV: tl.constexpr,
    DV_P2: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """o[t, h] = sum_s 2**lse_s o_s / (sum_s 2**lse_s + e**sink); lse (base 2, without the sink)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, DV_P2)
    dm = d < DV
    m = tl.full([1], float("-inf"), tl.float32)
    for s in range(n_split):
        m = tl.maximum(m, tl.load(plse_ptr + (t * n_split + s) * H + h + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([DV_P2], tl.float32)
    den = tl.zeros([1], tl.float32)
    for s in range(n_split):
        ls = tl.load(plse_ptr + (t * n_split + s) * H + h + tl.zeros([1], tl.int32))
        w = tl.exp2(ls - m_safe)
        den += w
        o = tl.load(part_ptr + ((t * n_split + s) * H + h) * DV + d, mask=dm, other=0.0)
        acc += w * o
    lse = tl.where(den > 0, m_safe + tl.log2(tl.where(den > 0, den, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * H + h + tl.zeros([1], tl.int32), lse)
    if HAS_SINK:
        sk = tl.load(sink_ptr + h + tl.zeros([1], tl.int32)) * 1.4426950408889634
        m2 = tl.maximum(m_safe, sk)
        den = den * tl.exp2(m_safe - m2) + tl.exp2(sk - m2)
        acc = acc * tl.exp2(m_safe - m2)
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + t * o_stride_t + h * o_stride_h + d, (acc / den).to(o_ptr.dtype.element_ty), mask=dm)
