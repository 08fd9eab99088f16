"""MLA-DSA lightning indexer: logits over the paged indexer-key pool (`indexer_logits`), then the causal
top-k as positions or cache slots (`indexer_topk`: one Triton launch; `indexer_topk_torch`: the same selection
in torch ops). Reference: `kernels_ref.indexer_logits_paged` + `functional.indexer_topk`.
"""

from __future__ import annotations

import torch
import triton

from ..configuration import SERVING_PAGE_SIZE
from ._pool import check, check_pool, dot_dtype, pool_args, pool_views
from ._triton.indexer import indexer_logits_kernel, indexer_logits_rows_kernel
from ._triton.topk import indexer_topk_kernel
from .layout import Geometry, KVLayout


def indexer_logits(
    qI: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    g: Geometry,
    page_table: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    max_len: int,
    out: torch.Tensor | None = None,
    keys_per_prog: int = 1024,
    config: tuple[int, ...] | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """Returns logits fp32 [T, max_len]: I(t, s) for s <= q_pos[t], -inf for s > q_pos[t], where
    I(t, s) = sum_h w[t, h] * ReLU(qI[t, h] . kI[s]) with kI[s] read through the request's page table.

    qI:         bf16 [T, nI, dI] (dI = g.dim: 128 at full size, any even width; RoPE already applied),
                last dim contiguous; fp32 runs the dots in IEEE fp32 (exactness runs with fp32 activations).
    w:          fp32 [T, nI] (weights_proj output times nI^-0.5 * dI^-0.5).
    pool:       indexer key pool, uint8 [pages, g.page_bytes] (IDX_FP8 or IDX_BF16).
    page_table: int32 [B, max_pages]: page of position s of request b is page_table[b, s // page_size].
    q_req:      int32 [T] request row of each query; q_pos: int32 [T] query position (keys s <= q_pos).
    max_len:    >= max(q_pos) + 1 (host int: the logits width).
    config:     (keys per step, warps, extend variant, keys major[, rows]): `LOGITS_DECODE` (the default) or
                `LOGITS_EXTEND` (kernels/_triton/indexer.py: the same logits, each variant faster for its rows;
                keys major puts the keys on the dot's M side, see `_head_sum`); rows > 1 (a power of two,
                extend variant) scores that many consecutive query rows per program against each key tile.
    """
    check(g.layout in (KVLayout.IDX_FP8, KVLayout.IDX_BF16), f"pool: an indexer layout, got {g.layout.value}")
    check_pool(pool, g, "indexer_logits.pool")
    a = pool_args(g)
    T, NI, DI = qI.shape
    check(
        qI.dim() == 3 and DI == g.dim and qI.dtype in (torch.bfloat16, torch.float32) and qI.stride(2) == 1,
        f"qI: bf16 (or fp32: IEEE fp32 dots) [T, nI, {g.dim}], got {qI.dtype} {tuple(qI.shape)}",
    )
    check(w.shape == (T, NI) and w.dtype == torch.float32 and w.stride(1) == 1, f"w: fp32 [{T}, {NI}]")
    check(
        page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1,
        "page_table: int32 [B, max_pages]",
    )
    check(
        page_table.shape[1] * g.page_size >= max_len,
        f"page_table: {page_table.shape[1]} pages < max_len {max_len}",
    )
    for n, x in (("q_req", q_req), ("q_pos", q_pos)):
        check(x.shape == (T,) and x.dtype == torch.int32 and x.is_contiguous(), f"{n}: int32 [{T}]")
    if out is None:
        out = torch.empty(T, max_len, dtype=torch.float32, device=qI.device)
    check(
        out.shape == (T, max_len) and out.dtype == torch.float32 and out.stride(1) == 1,
        "out: fp32 [T, max_len]",
    )
    if T == 0 or max_len == 0:
        return out
    block_n, num_warps, extend, keys_major, *more = config or LOGITS_DECODE
    rows = more[0] if more else 1
    check(
        rows == 1 or (extend and rows > 1 and rows & (rows - 1) == 0),
        f"indexer_logits config {config}: rows 1, or a power of two with the extend variant",
    )
    bni = max(16, triton.next_power_of_2(NI))
    check(
        rows * bni <= ROWS_HEADS_MAX or block_n <= 32,
        f"indexer_logits config {config} at {NI} heads: rows x heads {rows * bni} > {ROWS_HEADS_MAX} needs "
        f"keys per step <= 32 (the sm_90 build gave wrong logits at 64 keys x 512 rows x heads)",
    )
    keys_per_prog = triton.cdiv(min(keys_per_prog, max_len), block_n) * block_n
    grid = (triton.cdiv(T, rows), triton.cdiv(max_len, keys_per_prog))
    args = (qI, qI.stride(0), qI.stride(1), w, w.stride(0), page_table, page_table.stride(0), q_req, q_pos)
    args += (out, out.stride(0), max_len, keys_per_prog, NI) + ((T,) if rows > 1 else ())
    args += (*pool_views(pool), a.page_size, a.page_bytes, a.data_stride, a.scale_base, a.scale_stride)
    consts = dict(
        KIND=a.kind,
        DI=DI,
        DI_P=a.main_p,
        NOPE=a.nope,
        TILE=a.tile,
        BNI=bni,
        BN=block_n,
        DT=dot_dtype(qI.dtype == torch.float32),
        KM=keys_major,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if rows > 1:
        indexer_logits_rows_kernel[grid](*args, ROWS=rows, **consts)
    else:
        indexer_logits_kernel[grid](*args, EXTEND=extend, **consts)
    return out


# `indexer_logits` (keys per step, warps, extend variant, keys major[, rows]) for decode rows (one per
# request) and for extend rows (hundreds of one request's rows per indexer chunk), from bench_indexer.py and
# bench_decode.py: extend rows four per program, keys major, read each key tile once for four rows (512 rows
# x 32K keys on the H100: 921 us against 1606 for one row per program at 128 keys; docs/benchmarks.md 6.4)
LOGITS_DECODE = (64, 4, False, False)
LOGITS_EXTEND = (64, 4, True, True, 4)

# the rows kernel's dot holds rows x heads (padded) on one side: on the H100 its logits were wrong at 512 of
# them with 64 keys per step (4 and 8 warps), right at 512 with 32 keys and at 256 with 64 or 128 keys
ROWS_HEADS_MAX = 256


def _ordered_key(logits: torch.Tensor) -> torch.Tensor:
    """int64 key, larger = better: (order-preserving int of the fp32 logit, -0 read as +0) << 32 | (2**32 - 1 - s)."""
    b = (logits + 0.0).contiguous().view(torch.int32).to(torch.int64)  # -0.0 + 0.0 = +0.0: equal floats tie
    u = torch.where(b < 0, (~b) & 0xFFFFFFFF, b | 0x80000000)  # monotone uint32 of the float
    s = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    return ((u - 0x80000000) << 32) | (0xFFFFFFFF - s)


def indexer_topk(
    logits: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    page_table: torch.Tensor | None = None,
    q_req: torch.Tensor | None = None,
    page_size: int = SERVING_PAGE_SIZE,
    config: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions per query (the index_topk largest I(t, s), s <= q_pos; ties to the earlier s; -0 equals +0)
    and their count, in one launch.

    logits fp32 [T, S] from indexer_logits (row stride free, last dim contiguous); q_pos [T] (int32: used as
    is) with q_pos < S. Returns (idx int32 [T, topk], lengths int32 [T]) where lengths = min(q_pos + 1, topk) and
    idx[t, :lengths[t]] are the selected positions in increasing position order (or, with page_table / q_req,
    their cache slots page_table[q_req, s // page_size] * page_size + s % page_size), -1 after them: the
    `indices` / `topk_length` of sparse_mqa_attention and FlashMLA (which take the keys in any order).
    config: (keys per step, warps[, sample]), default `topk_config(T)`; sample > 0 (a power of two): rows of
    2 sample to topk * sample / 8 keys select among candidates above a sampled threshold (the kernel's
    docstring), with the same result, through a scratch buffer of 4 topk logits and positions per row (taken
    where the chunk is at least 2 sample wide and the buffer no larger than the logits or 32 MiB; else 0).
    """
    T, S = logits.shape
    check(logits.dtype == torch.float32 and logits.stride(1) == 1, "logits: fp32 [T, S], last dim contiguous")
    check(q_pos.shape == (T,) and not q_pos.is_floating_point(), f"q_pos: integer [{T}]")
    q_pos = q_pos.to(torch.int32).contiguous()  # no copy when it already is (the backend's rows are)
    slots = page_table is not None
    if slots:
        check(q_req is not None, "indexer_topk: q_req is needed with page_table")
        check(q_req.shape == (T,) and not q_req.is_floating_point(), f"q_req: integer [{T}]")
        q_req = q_req.to(torch.int32).contiguous()
        check(
            page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1,
            "page_table: int32 [B, max_pages]",
        )
    idx = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    lengths = torch.empty(T, dtype=torch.int32, device=logits.device)
    if T == 0:
        return idx, lengths
    block, num_warps, *rest = config or topk_config(T)
    sample = rest[0] if rest else 0
    check(
        sample == 0 or (sample >= 16 and sample & (sample - 1) == 0), f"top-k sample {sample}: 0 or 2^i >= 16"
    )
    cap = 4 * topk
    # no row of a narrower chunk samples; and the scratch stays within the logits' own size (or 32 MiB): a
    # wide extend chunk of short rows would otherwise ask for several times its logits
    if sample and (S < 2 * sample or T * cap * 2 > max(T * S, 1 << 23)):
        sample = 0
    cand, cand_pos = logits, idx  # not read without sample
    if sample:
        cand = torch.empty(T, cap, dtype=torch.float32, device=logits.device)
        cand_pos = torch.empty(T, cap, dtype=torch.int32, device=logits.device)
    indexer_topk_kernel[(T,)](
        logits,
        logits.stride(0),
        q_pos,
        q_req if slots else q_pos,
        page_table if slots else q_pos,
        page_table.stride(0) if slots else 0,
        idx,
        idx.stride(0),
        lengths,
        cand,
        cand_pos,
        S,
        page_size,
        min(topk, S),
        TOPK=topk,
        SLOTS=slots,
        BLOCK=block,
        SAMPLE=sample,
        CAP=cap,
        num_warps=num_warps,
    )
    return idx, lengths


# (keys per step, warps, sample) by rows: one program walks a whole row, so few rows (decode at small batch, a
# GPU mostly idle) take wide steps over many warps, and many rows (one program or more per SM) narrow ones;
# the sampled threshold leaves the radix passes a tenth of a 32K row (3.0x faster on the chunk and on decode)
TOPK_CONFIGS = ((64, (4096, 16, 1024)), (256, (2048, 8, 1024)), (None, (1024, 4, 1024)))


def topk_config(rows: int) -> tuple[int, int, int]:
    """`indexer_topk`'s default (keys per step, warps, sample) for `rows` query rows (TOPK_CONFIGS)."""
    return next(cfg for below, cfg in TOPK_CONFIGS if below is None or rows < below)


def indexer_topk_torch(
    logits: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    page_table: torch.Tensor | None = None,
    q_req: torch.Tensor | None = None,
    page_size: int = SERVING_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer_topk` in torch ops (the selected keys in descending logit order): the twin the start-up check
    compares the kernel with, and the path where Triton does not run."""
    T, S = logits.shape
    check(logits.dtype == torch.float32, "logits: fp32")
    check(q_pos.shape == (T,), f"q_pos: [{T}]")
    lengths = torch.clamp(q_pos.to(torch.int64) + 1, max=min(topk, S))
    k = min(topk, S)
    key = _ordered_key(logits)
    top = torch.topk(key, k, dim=1, sorted=True).indices if T else key[:, :k]
    valid = torch.arange(k, device=logits.device)[None, :] < lengths[:, None]
    pos = torch.where(valid, top, -1)
    if page_table is not None:
        assert q_req is not None
        pg = page_table[q_req.long()[:, None], pos.clamp_min(0) // page_size].to(torch.int64)
        pos = torch.where(valid, pg * page_size + pos.clamp_min(0) % page_size, -1)
    if k < topk:
        pos = torch.cat([pos, pos.new_full((T, topk - k), -1)], 1)
    return pos.to(torch.int32), lengths.to(torch.int32)
