"""Triton bodies of kernels/sparse_attn.py: gather + dequant + one-softmax MQA over up to two paged scopes,
split over keys, then a combine pass that adds the per-head sink. Split grid: (head block, query t, key split),
head blocks fastest so programs reading the same keys run together; split s covers [s * chunk, (s + 1) * chunk)
of [main[0:len_a] | extra[0:len_b]]. The head dim is cut into NC = MAIN_P / DC chunks (comment below). Softmax
in base 2. ``DT``: bf16 dot operands on GPUs; fp32 for fp32 queries and under the interpreter (its bf16 dot is
wrong)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import cols, load_chunk, row_ptrs, token_rows

# Registers: a [64, 512] fp32 accumulator is 128 registers per thread at 8 warps, and the 255-register cap leaves
# little for the key tile. So every key block is read as NC tiles of [BN, DC] (``load_chunk``: a chunk lies
# wholly in the fp8 or the bf16 part of a row) and each goes straight into shared memory as the MMA operand of
# both products (S = sum_c q_c k_c^T; acc_c += P k_c): one [BN, DC] chunk is live in registers at a time (a
# full-width [BN, MAIN_P] tile, two of them for the HCA fp8 row's fp8 and bf16 parts, spills). The query is NC
# [BH, DC] tiles loaded once (the compiler stages them in shared memory), the accumulator NC tiles [BH, DC]
# (NC <= 8). The two scopes are one loop over the virtual concatenation [main[0:len_a] | extra[0:len_b]] (a
# block that straddles the boundary takes each key's row pointers from its own pool), not two loops: a second
# copy of the loop body keeps its own loop-invariant addresses live and spills.


@triton.jit
def _qk_chunk(
    s,
    q_c,
    f8_row,
    bf_row,
    sc_row,
    valid,
    C: tl.constexpr,
    DC: tl.constexpr,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr,
):
    k_c = load_chunk(f8_row, bf_row, sc_row, valid, C * DC, DC, KIND, MAIN, NOPE, TILE, BN, DT)
    return tl.dot(q_c, tl.trans(k_c), s, input_precision="ieee"), k_c


@triton.jit
def _load_q_chunk(
    q_ptr,
    t,
    q_stride_t,
    q_stride_h,
    h,
    hmask,
    C: tl.constexpr,
    DC: tl.constexpr,
    MAIN: tl.constexpr,
    DT: tl.constexpr,
):
    d = C * DC + tl.arange(0, DC)
    return tl.load(
        q_ptr + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
        mask=cols(hmask[:, None], d, MAIN, C * DC + DC),
        other=0.0,
    ).to(DT)


@triton.jit
def _scaled(a, mul, div, HAS_MUL: tl.constexpr):
    """(a * mul) / div (rows): the epilogue's order of operations."""
    if HAS_MUL:
        a = a * mul[:, None]
    return a / div[:, None]


@triton.jit
def _store_all(
    ptr,
    a0,
    a1,
    a2,
    a3,
    a4,
    a5,
    a6,
    a7,
    acc_t,
    mul,
    div,
    hmask,
    HAS_MUL: tl.constexpr,
    NC: tl.constexpr,
    DC: tl.constexpr,
    MAIN: tl.constexpr,
    TAIL: tl.constexpr,
    TAIL_P: tl.constexpr,
    V_TAIL: tl.constexpr,
):
    """ptr: [BH, 1] row pointers; chunk c of the accumulator -> dims c*DC .. (c+1)*DC - 1 (in ptr's dtype),
    those < MAIN (columns past the row's width hold padding and store nothing)."""
    d = tl.arange(0, DC)
    ty = ptr.dtype.element_ty
    m = hmask[:, None]
    tl.store(ptr + d[None, :], _scaled(a0, mul, div, HAS_MUL).to(ty), mask=cols(m, d, MAIN, DC))
    if NC > 1:
        tl.store(
            ptr + 1 * DC + d[None, :],
            _scaled(a1, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 1 * DC + d, MAIN, 2 * DC),
        )
    if NC > 2:
        tl.store(
            ptr + 2 * DC + d[None, :],
            _scaled(a2, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 2 * DC + d, MAIN, 3 * DC),
        )
    if NC > 3:
        tl.store(
            ptr + 3 * DC + d[None, :],
            _scaled(a3, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 3 * DC + d, MAIN, 4 * DC),
        )
    if NC > 4:
        tl.store(
            ptr + 4 * DC + d[None, :],
            _scaled(a4, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 4 * DC + d, MAIN, 5 * DC),
        )
    if NC > 5:
        tl.store(
            ptr + 5 * DC + d[None, :],
            _scaled(a5, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 5 * DC + d, MAIN, 6 * DC),
        )
    if NC > 6:
        tl.store(
            ptr + 6 * DC + d[None, :],
            _scaled(a6, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 6 * DC + d, MAIN, 7 * DC),
        )
    if NC > 7:
        tl.store(
            ptr + 7 * DC + d[None, :],
            _scaled(a7, mul, div, HAS_MUL).to(ty),
            mask=cols(m, 7 * DC + d, MAIN, 8 * DC),
        )
    if V_TAIL:
        dt = tl.arange(0, TAIL_P)
        tl.store(
            ptr + MAIN + dt[None, :], _scaled(acc_t, mul, div, HAS_MUL).to(ty), mask=cols(m, dt, TAIL, TAIL_P)
        )


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
    b_delta,
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
    DC: tl.constexpr,
):
    """The split pass (module docstring). The extra pool is addressed from the main pool's views: ``b_delta`` =
    its base address minus the main pool's (bytes, a multiple of 4), so that one pointer per view serves both
    scopes (a select between two pointer tensors would hide their alignment from the compiler: byte-wise
    loads)."""
    NC: tl.constexpr = MAIN_P // DC
    hb = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    LOG2E: tl.constexpr = 1.4426950408889634
    qk_scale = sm_scale * LOG2E

    h = hb * BH + tl.arange(0, BH)
    hmask = h < H
    q0 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 0, DC, MAIN, DT)
    q1 = q0
    q2 = q0
    q3 = q0
    q4 = q0
    q5 = q0
    q6 = q0
    q7 = q0
    if NC > 1:
        q1 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 1, DC, MAIN, DT)
    if NC > 2:
        q2 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 2, DC, MAIN, DT)
    if NC > 3:
        q3 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 3, DC, MAIN, DT)
    if NC > 4:
        q4 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 4, DC, MAIN, DT)
    if NC > 5:
        q5 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 5, DC, MAIN, DT)
    if NC > 6:
        q6 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 6, DC, MAIN, DT)
    if NC > 7:
        q7 = _load_q_chunk(q_ptr, t, q_stride_t, q_stride_h, h, hmask, 7, DC, MAIN, DT)
    if TAIL > 0:
        dt = tl.arange(0, TAIL_P)
        q_t = tl.load(
            q_ptr + t * q_stride_t + h[:, None] * q_stride_h + MAIN + dt[None, :],
            mask=cols(hmask[:, None], dt, TAIL, TAIL_P),
            other=0.0,
        ).to(DT)
    else:
        q_t = q0

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
    a0 = tl.zeros([BH, DC], tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    if V_TAIL:
        acc_t = tl.zeros([BH, TAIL_P], tl.float32)
    else:
        acc_t = tl.zeros([BH, 1], tl.float32)

    # keys [start, end) of the concatenation [main[0:len_a] | extra[0:len_b]]
    start = sp * chunk
    hi = tl.minimum(start + chunk, len_a + len_b)
    offs = tl.arange(0, BN)
    for n0 in range(start, hi, BN):
        n = n0 + offs
        inb = n < hi
        in_a = n < len_a
        slots = tl.load(ia_ptr + t * ia_stride + n, mask=inb & in_a, other=-1)
        row, srow = token_rows(slots, a_ps, a_pb, a_ds, a_sb, a_ss)
        if HAS_B:  # extra-pool rows as byte offsets from the main pool's base (b_delta = b base - a base)
            slots_b = tl.load(ib_ptr + t * ib_stride + (n - len_a), mask=inb & (n >= len_a), other=-1)
            row_b, srow_b = token_rows(slots_b, b_ps, b_pb, b_ds, b_sb, b_ss)
            slots = tl.where(in_a, slots, slots_b)
            # blend, not tl.where: the compiler's alignment analysis (Triton 3.8) drops the divisibility of a
            # select between non-contiguous offsets, and the loads would go byte by byte
            sel = in_a.to(tl.int64)
            row_b += b_delta
            srow_b += b_delta
            row = row_b + sel * (row - row_b)
            srow = srow_b + sel * (srow - srow_b)
        valid = inb & (slots >= 0)
        f8_row, bf_row, sc_row = row_ptrs(row, srow, a_u8, a_f8, a_bf, a_f32, KIND)
        s = tl.zeros([BH, BN], tl.float32)
        s, k0 = _qk_chunk(s, q0, f8_row, bf_row, sc_row, valid, 0, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 1:
            s, k1 = _qk_chunk(s, q1, f8_row, bf_row, sc_row, valid, 1, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 2:
            s, k2 = _qk_chunk(s, q2, f8_row, bf_row, sc_row, valid, 2, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 3:
            s, k3 = _qk_chunk(s, q3, f8_row, bf_row, sc_row, valid, 3, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 4:
            s, k4 = _qk_chunk(s, q4, f8_row, bf_row, sc_row, valid, 4, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 5:
            s, k5 = _qk_chunk(s, q5, f8_row, bf_row, sc_row, valid, 5, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 6:
            s, k6 = _qk_chunk(s, q6, f8_row, bf_row, sc_row, valid, 6, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if NC > 7:
            s, k7 = _qk_chunk(s, q7, f8_row, bf_row, sc_row, valid, 7, DC, KIND, MAIN, NOPE, TILE, BN, DT)
        if TAIL > 0:
            kt = tl.load(
                bf_row[:, None] + (TAIL_OFF // 2 + tl.arange(0, TAIL_P))[None, :],
                mask=cols(valid[:, None], tl.arange(0, TAIL_P), TAIL, TAIL_P),
                other=0.0,
            ).to(DT)
            s = tl.dot(q_t, tl.trans(kt), s, input_precision="ieee")
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = p.to(DT)
        a0 = a0 * alpha[:, None] + tl.dot(pb, k0, input_precision="ieee")
        if NC > 1:
            a1 = a1 * alpha[:, None] + tl.dot(pb, k1, input_precision="ieee")
        if NC > 2:
            a2 = a2 * alpha[:, None] + tl.dot(pb, k2, input_precision="ieee")
        if NC > 3:
            a3 = a3 * alpha[:, None] + tl.dot(pb, k3, input_precision="ieee")
        if NC > 4:
            a4 = a4 * alpha[:, None] + tl.dot(pb, k4, input_precision="ieee")
        if NC > 5:
            a5 = a5 * alpha[:, None] + tl.dot(pb, k5, input_precision="ieee")
        if NC > 6:
            a6 = a6 * alpha[:, None] + tl.dot(pb, k6, input_precision="ieee")
        if NC > 7:
            a7 = a7 * alpha[:, None] + tl.dot(pb, k7, input_precision="ieee")
        if V_TAIL:
            acc_t = acc_t * alpha[:, None] + tl.dot(pb, kt, input_precision="ieee")
        m_i = m_new

    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    if SINGLE:
        denom = l_i
        mul = l_i
        if HAS_SINK:
            sk = tl.load(sink_ptr + h, mask=hmask, other=0.0) * LOG2E
            m2 = tl.maximum(m_i, sk)
            denom = l_i * tl.exp2(m_safe - m2) + tl.exp2(sk - m2)
            mul = tl.exp2(m_safe - m2)
        denom = tl.where(denom == 0.0, 1.0, denom)
        optr = o_ptr + t * o_stride_t + h[:, None] * o_stride_h
        _store_all(
            optr,
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
            a6,
            a7,
            acc_t,
            mul,
            denom,
            hmask,
            HAS_SINK,
            NC,
            DC,
            MAIN,
            TAIL,
            TAIL_P,
            V_TAIL,
        )
        lse = tl.where(l_i > 0, m_safe + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * H + h, lse, mask=hmask)
    else:
        DV: tl.constexpr = MAIN + TAIL if V_TAIL else MAIN
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        pbase = part_ptr + ((t * n_split + sp) * H + h[:, None]) * DV
        _store_all(
            pbase,
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
            a6,
            a7,
            acc_t,
            l_safe,
            l_safe,
            hmask,
            False,
            NC,
            DC,
            MAIN,
            TAIL,
            TAIL_P,
            V_TAIL,
        )
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
