"""Triton helpers shared by the kernels: power-of-two fp8 scales and the paged-pool token reader / writer.

A pool is read through four typed views of the same bytes (uint8, e4m3, bf16, fp32); offsets are in bytes.
``KIND``: 0 bf16, 1 fp8 + ue8m0 scale bytes (HCA_FP8), 2 fp8 + fp32 scales (MLA_FP8 / IDX_FP8). A row of
``MAIN`` values is held as ``MAIN_P`` columns (``_pool.padded``); padding columns read 0 and are never stored,
and their masks exist only when there are such columns (``cols`` / ``within``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...checkpoint.spec import FP8_MAX
from ..layout import FP8_AMAX_EPS

KIND_BF16 = 0
KIND_FP8_UE8M0 = 1
KIND_FP8_F32 = 2

E4M3_MAX = tl.constexpr(FP8_MAX)
AMAX_EPS = tl.constexpr(FP8_AMAX_EPS)
# pow2_exponent's bit trick reads 448 as 1.75 * 2**8
assert FP8_MAX == 1.75 * 2**8


@triton.jit
def pow2_exponent(amax):
    """e = ceil(log2(amax / 448)) for fp32 amax >= 1e-8 (normal), exactly, from the bits:
    amax = m * 2**k, 448 = 1.75 * 2**8 -> e = k - 8 + (m > 1.75)."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127
    m = bits & 0x7FFFFF
    return k - 8 + (m > 0x600000).to(tl.int32)


@triton.jit
def pow2_float(e):
    """2 ** e as fp32 for integer e in [-126, 127], exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the e4m3 grid, nearest even, in fp32 arithmetic: the cast
    that follows is then exact everywhere (the CPU interpreter's own fp8 cast does not round to
    nearest even)."""
    bits = x.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127
    k = tl.maximum(k, -6) - 3  # grid step 2**k (subnormals: 2**-9)
    y = tl.abs(x) * pow2_float(-k)  # |y| < 16, exact
    r = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: fp32 add rounds to nearest even integer
    r = r * pow2_float(k)
    return tl.where(bits < 0, -r, r)  # keeps the sign of values that round to zero (-0, as torch)


@triton.jit
def e4m3_bits(r, x):
    """The e4m3fn byte (uint8) of an fp32 value ``r`` already on the e4m3 grid (round_e4m3 output of
    ``x``), in integer arithmetic with the sign bit of ``x``: values that round to zero keep their sign (-0,
    as torch's cast), which float code loses on the GPU (ptxas folds ``where(x < 0, -r, r)`` of a zero)."""
    b = r.to(tl.int32, bitcast=True)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    e = ((b >> 23) & 0xFF) - 127
    normal = ((e + 7) << 3) | ((b >> 20) & 7)
    sub = (tl.abs(r) * 512.0).to(tl.int32)  # subnormal: multiples of 2**-9
    return (tl.where(e >= -6, normal, sub) | sign).to(tl.uint8)


@triton.jit
def round_bf16(x):
    """x (fp32, finite) rounded to bf16 nearest-even in integer arithmetic; the cast that follows is
    then exact (the CPU interpreter's own bf16 cast truncates)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def cols(mask, d, W: tl.constexpr, END: tl.constexpr):
    """``mask`` [rows, n] limited to the columns ``d < W`` of a W-wide row, where ``d`` [n] are column indices
    that end before END (the padded width, or a chunk's end); returned as it is when END <= W (no column
    past the row: no extra mask, the unpadded code)."""
    if END > W:
        mask = mask & (d < W)[None, :]
    return mask


@triton.jit
def within(mask, d, W: tl.constexpr, END: tl.constexpr):
    """``cols`` for a 1-D ``mask`` [n]."""
    if END > W:
        mask = mask & (d < W)
    return mask


@triton.jit
def token_rows(slots, page_size, page_bytes, data_stride, scale_base, scale_stride):
    """Byte offsets (int64) of each slot's data row and scale row."""
    s = slots.to(tl.int64)
    page = s // page_size
    off = s - page * page_size
    base = page * page_bytes
    return base + off * data_stride, base + scale_base + off * scale_stride


@triton.jit
def load_main(
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    row,
    srow,
    valid,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr = tl.float32,
):
    """[BN, MAIN_P] values (dtype DT) of the main segment of BN tokens (rows/srows [BN] byte offsets); columns
    >= MAIN are 0.

    Dims d < NOPE are fp8 at ``row + d`` times their tile's scale (KIND 1/2); dims d >= NOPE are
    bf16 at ``row + NOPE + 2 * (d - NOPE)`` (all of them for KIND 0, where NOPE = 0). The scales are
    powers of two, so e4m3 * scale is exact in bf16: DT = bf16 keeps the tile at half the registers."""
    d = tl.arange(0, MAIN_P)
    vmask = valid[:, None]
    if KIND == 0:
        v = tl.load(
            bf_ptr + (row[:, None] + 2 * d[None, :]) // 2, mask=cols(vmask, d, MAIN, MAIN_P), other=0.0
        ).to(DT)
    else:
        NT: tl.constexpr = MAIN_P // TILE
        NQT: tl.constexpr = (NOPE + TILE - 1) // TILE  # tiles holding fp8 dims
        is_q = d < NOPE
        q = tl.load(f8_ptr + row[:, None] + d[None, :], mask=vmask & is_q[None, :], other=0.0).to(DT)
        t = tl.arange(0, NT)
        tmask = vmask & (t < NQT)[None, :]
        if KIND == 1:
            sb = tl.load(u8_ptr + srow[:, None] + t[None, :], mask=tmask, other=127).to(tl.int32)
            sc = (sb << 23).to(tl.float32, bitcast=True)
        else:
            sc = tl.load(f32_ptr + (srow[:, None] + 4 * t[None, :]) // 4, mask=tmask, other=1.0)
        q = tl.reshape(tl.reshape(q, (BN, NT, TILE)) * sc.to(DT)[:, :, None], (BN, MAIN_P))
        if NOPE < MAIN:
            b = tl.load(
                bf_ptr + (row[:, None] + NOPE + 2 * (d[None, :] - NOPE)) // 2,
                mask=cols(vmask & (d >= NOPE)[None, :], d, MAIN, MAIN_P),
                other=0.0,
            ).to(DT)
            v = tl.where(is_q[None, :], q, b)
        else:
            v = q
    return v


@triton.jit
def row_ptrs(row, srow, u8_ptr, f8_ptr, bf_ptr, f32_ptr, KIND: tl.constexpr):
    """Typed pointers to data rows (e4m3 view, bf16 view) and scale rows (ue8m0 bytes for KIND 1, fp32 for
    KIND 2; the uint8 view otherwise) at byte offsets ``row`` / ``srow`` (``token_rows``). Data rows start at
    even bytes, fp32 scale rows at multiples of 4 (every layout keeps its fields aligned), so the typed views
    index them exactly."""
    if KIND == 2:
        sc = f32_ptr + srow // 4
    else:
        sc = u8_ptr + srow
    return f8_ptr + row, bf_ptr + row // 2, sc


@triton.jit
def _tile_scale(sc_row, valid, T0: tl.constexpr, KIND: tl.constexpr):
    """[BN] fp32 scale of fp8 tile T0 of each row (1 where not valid)."""
    if KIND == 1:
        sb = tl.load(sc_row + T0, mask=valid, other=127).to(tl.int32)
        return (sb << 23).to(tl.float32, bitcast=True)
    else:
        return tl.load(sc_row + T0, mask=valid, other=1.0)


@triton.jit
def load_chunk(
    f8_row,
    bf_row,
    sc_row,
    valid,
    D0: tl.constexpr,
    W: tl.constexpr,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    BN: tl.constexpr,
    DT: tl.constexpr = tl.float32,
):
    """[BN, W] values (dtype DT) of main-segment dims D0 .. D0 + W - 1 of BN tokens given their row pointers
    (``row_ptrs``): the same values as those columns of ``load_main`` (same loads, same dequantisation), read
    chunk by chunk so that only W columns are live in registers. Requires D0 % W == 0 and, for fp8 kinds,
    TILE % W == 0 or W % TILE == 0. A chunk that lies wholly in the fp8 (d < NOPE) or in the bf16 part reads
    only that part (no select between two full-width loads). Columns >= MAIN (the padding of a row that is
    not a power of two wide) are 0; a chunk of padding only reads nothing."""
    d = D0 + tl.arange(0, W)
    vmask = valid[:, None]
    if D0 >= MAIN:
        v = tl.zeros([BN, W], DT)
    elif KIND == 0:
        v = tl.load(bf_row[:, None] + d[None, :], mask=cols(vmask, d, MAIN, D0 + W), other=0.0).to(DT)
    elif D0 >= NOPE:  # bf16 dims only (at byte NOPE + 2 * (d - NOPE) of the row)
        v = tl.load(
            bf_row[:, None] + (d[None, :] - NOPE // 2), mask=cols(vmask, d, MAIN, D0 + W), other=0.0
        ).to(DT)
    else:
        if D0 + W > NOPE:
            q = tl.load(f8_row[:, None] + d[None, :], mask=vmask & (d < NOPE)[None, :], other=0.0).to(DT)
        else:
            q = tl.load(f8_row[:, None] + d[None, :], mask=vmask, other=0.0).to(DT)
        if W <= TILE:  # one scale per token
            q = q * _tile_scale(sc_row, valid, D0 // TILE, KIND).to(DT)[:, None]
        else:  # W // TILE tiles: each column takes its tile's scale (a select per column, no 3-D reshape)
            sc = _tile_scale(sc_row, valid, D0 // TILE, KIND).to(DT)[:, None] + tl.zeros([BN, W], DT)
            for j in tl.static_range(1, W // TILE):
                if D0 + j * TILE < NOPE:
                    sj = _tile_scale(sc_row, valid, D0 // TILE + j, KIND).to(DT)
                    sc = tl.where((d >= D0 + j * TILE)[None, :], sj[:, None], sc)
            q = q * sc
        if D0 + W > NOPE:
            b = tl.load(
                bf_row[:, None] + (d[None, :] - NOPE // 2),
                mask=cols(vmask & (d >= NOPE)[None, :], d, MAIN, D0 + W),
                other=0.0,
            ).to(DT)
            v = tl.where((d < NOPE)[None, :], q, b)
        else:
            v = q
    return v


@triton.jit
def encode_store(
    x,
    row,
    srow,
    u8_ptr,
    f8_ptr,
    bf_ptr,
    f32_ptr,
    KIND: tl.constexpr,
    MAIN: tl.constexpr,
    MAIN_P: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """Store one token's main segment x [MAIN_P] fp32 (columns >= MAIN zero, never stored) at data row ``row``
    / scale row ``srow`` (bytes): bf16 (KIND 0), or fp8 dims < NOPE with power-of-two tile scales (ue8m0 bytes
    for KIND 1, fp32 for KIND 2) and bf16 dims >= NOPE at ``row + NOPE + 2 * (d - NOPE)``."""
    d = tl.arange(0, MAIN_P)
    if KIND == 0:
        if MAIN_P > MAIN:
            tl.store(bf_ptr + (row + 2 * d) // 2, round_bf16(x).to(tl.bfloat16), mask=d < MAIN)
        else:
            tl.store(bf_ptr + (row + 2 * d) // 2, round_bf16(x).to(tl.bfloat16))
    else:
        NT: tl.constexpr = MAIN_P // TILE
        NQT: tl.constexpr = (NOPE + TILE - 1) // TILE  # tiles holding fp8 dims
        t = tl.arange(0, NT)
        is_q = d < NOPE
        x3 = tl.reshape(x, (NT, TILE))
        amax = tl.maximum(tl.max(tl.abs(x3), axis=1), AMAX_EPS)
        e = pow2_exponent(amax)
        q = tl.reshape(x3 * pow2_float(-e)[:, None], (MAIN_P,))
        r = round_e4m3(tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX))
        tl.store(u8_ptr + row + d, e4m3_bits(r, q), mask=is_q)
        if NOPE < MAIN:
            tl.store(
                bf_ptr + (row + NOPE + 2 * (d - NOPE)) // 2,
                round_bf16(x).to(tl.bfloat16),
                mask=within(d >= NOPE, d, MAIN, MAIN_P),
            )
        if KIND == 1:
            sb = tl.where(t < NQT, e + 127, 0).to(tl.uint8)
            tl.store(u8_ptr + srow + t, sb, mask=t < SCALE_BYTES)
        else:
            tl.store(f32_ptr + (srow + 4 * t) // 4, pow2_float(e), mask=t < NQT)
