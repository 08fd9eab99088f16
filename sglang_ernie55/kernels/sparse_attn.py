"""Sparse MQA attention over paged pools: the one kernel behind HCA attention (decode and extend) and
MLA-DSA sparse attention (absorbed form), fp8 and bf16 pools, any even widths.

The call is FlashMLA's sparse decode (slot indices, -1 invalid, per-query lengths, an extra cache, a sink),
so `flashmla_sparse_attention` serves the same call where FlashMLA's geometry fits.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton

from ._pool import PoolArgs, check, check_pool, dot_dtype, pool_args, pool_views
from ._triton.sparse_attn import sparse_attn_combine_kernel, sparse_attn_split_kernel
from .layout import Geometry, KVLayout

LN2 = math.log(2.0)
LAST_COMPILED: dict = {}  # diagnostics: the last compiled split kernel (n_regs / n_spills / asm)


# Head-dim chunk of the split kernel: at 512 dims, 4 chunks of [64, 128] accumulator / [block_n, 128] key tiles.
# With block_n 32, 8 warps and 2 stages the offline sm_90 compile spills nothing at the serving shapes (HCA /
# MLA, fp8 / bf16; docs/kernels.md "Register pressure"); 2 stages let Triton pipeline the key loads and overlap
# the PV product with the next block. fp32 queries (fp32 operand tiles, twice the bytes) take 1 stage: with 2,
# 64 heads need more shared memory than an sm_90 block may have (offline compile: up to 258176 B of 232448).
BLOCK_D = 128
STAGES = 2
STAGES_FP32 = 1
MAX_CHUNKS = 8  # the kernel holds at most 8 query / accumulator chunks


def _block_d(a: PoolArgs, block_d: int | None) -> int:
    """The head-dim chunk for a pool: ``block_d`` checked, or BLOCK_D fitted to the padded main width."""
    if block_d is None:
        return max(min(BLOCK_D, a.main_p), a.main_p // MAX_CHUNKS)
    bd = block_d
    check(
        bd >= 16 and bd & (bd - 1) == 0 and a.main_p % bd == 0 and a.main_p // bd <= MAX_CHUNKS,
        f"block_d: a power of two >= 16 dividing {a.main_p} into at most {MAX_CHUNKS} chunks, got {bd}",
    )
    return bd


@dataclasses.dataclass
class Scope:
    """One set of keys: a pool, its geometry, per-query slot lists and (optional) lengths.

    pool:    uint8 [num_pages, geom.page_bytes], contiguous.
    indices: int32 [T, K], row stride free, last dim contiguous; slot = page * page_size + offset; -1 = none.
    lengths: int32 [T] or None (None: all K entries are read; -1 entries are skipped either way).
    """

    pool: torch.Tensor
    geom: Geometry
    indices: torch.Tensor
    lengths: torch.Tensor | None = None


def _check_scope(sc: Scope, T: int, name: str) -> None:
    check_pool(sc.pool, sc.geom, f"{name}.pool")
    idx = sc.indices
    check(
        idx.dim() == 2 and idx.shape[0] == T, f"{name}.indices: expected [T={T}, K], got {tuple(idx.shape)}"
    )
    check(idx.dtype == torch.int32 and idx.stride(1) == 1, f"{name}.indices: int32 with contiguous last dim")
    if sc.lengths is not None:
        ln = sc.lengths
        check(
            ln.shape == (T,) and ln.dtype == torch.int32,
            f"{name}.lengths: expected int32 [{T}], got {ln.dtype} {tuple(ln.shape)}",
        )
        check(ln.is_contiguous(), f"{name}.lengths: contiguous")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def sparse_mqa_attention(
    q: torch.Tensor,
    main: Scope,
    extra: Scope | None = None,
    *,
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int = 32,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_keys: int | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token t and head h, over the keys S_t (the valid slots of main, then extra; K = V):

        o[t, h] = sum_{k in S_t} exp(q.k * sm_scale) k[:d_v] / (sum_{k in S_t} exp(q.k * sm_scale) + exp(sink[h]))

    keys dequantised as `torch_twin.pool_gather` does; no sink term when ``sink`` is None; 0 for an empty S_t.
    Reference: `kernels_ref.sparse_attention`. HCA: main = window pool, extra = compressed pool, sink =
    attn_sink, d_v = head_dim (the rope slice still carries RoPE: `rope.inverse_rope_` after). MLA-DSA
    (absorbed): q = [q_nope W_UK | q_pe], main = latent pool at the top-k slots, d_v = latent (W_UV after).

    Returns (out [T, h, d_v] bf16 (or ``out``'s dtype), lse [T, h] fp32, natural log, without the sink).

    q:     [T, h, D] bf16, last dim contiguous; D = main.geom main + rope widths (HCA 512, MLA 576 at full
           size; any even widths, e.g. HCA 96, MLA 96 + 32). An fp32 q runs every dot in IEEE fp32 (keys and
           softmax weights too): the exactness mode of fp32 activations.
    main:  Scope (see above); extra: optional Scope with the same layout kind (HCA compressed pool).
    sink:  fp32 [h] raw logits (added as exp(sink) to the denominator) or None.
    d_v:   the main width (value = first d_v dims of the key: HCA head_dim, MLA latent) or main + rope.
    out:   optional [T, h, d_v] tensor written in place (any float dtype; last dim contiguous).
    num_splits / block_h / block_n / num_warps / num_stages / block_d: tuning; defaults pick a split count
           that gives ~2 programs per SM, 64 heads per program (fewer for fewer heads) on 8 warps, 32 keys
           per block, `STAGES` pipeline stages (`STAGES_FP32` for fp32 queries) and `BLOCK_D`-dim chunks of
           the head dim (a power of two >= 16 dividing the padded main width into at most 8 chunks).
    split_keys: batch-invariant mode (SGLang's --enable-deterministic-inference): every split covers
           exactly this many keys of the query's own key sequence (a multiple of block_n) and the result
           always goes through the combine pass, so a query's output depends only on its own keys, never
           on the batch's size, index widths or the other queries (the default split count follows the
           batch: T and the widest index row). Excludes ``num_splits``.
    """
    a = pool_args(main.geom)
    T, H, D = q.shape
    check(
        q.dim() == 3 and D == a.main + a.tail, f"q: expected [T, h, {a.main + a.tail}], got {tuple(q.shape)}"
    )
    check(
        q.dtype in (torch.bfloat16, torch.float32) and q.stride(2) == 1,
        f"q: bf16 (or fp32: IEEE fp32 dots, exactness runs) with contiguous last dim, got {q.dtype}",
    )
    _check_scope(main, T, "main")
    if extra is not None:
        _check_scope(extra, T, "extra")
        b = pool_args(extra.geom)
        check(
            (b.kind, b.main, b.nope, b.tile, b.tail, b.tail_off)
            == (a.kind, a.main, a.nope, a.tile, a.tail, a.tail_off),
            f"extra: layout {extra.geom.layout.value}/{extra.geom.dim} must encode tokens like main's "
            f"{main.geom.layout.value}/{main.geom.dim}",
        )
    check(d_v in (a.main, a.main + a.tail), f"d_v: must be {a.main} (or {a.main + a.tail}), got {d_v}")
    v_tail = d_v == a.main + a.tail and a.tail > 0
    if sink is not None:
        check(
            sink.shape == (H,) and sink.dtype == torch.float32 and sink.is_contiguous(), f"sink: fp32 [{H}]"
        )
    if out is None:
        out = torch.empty(T, H, d_v, dtype=torch.bfloat16, device=q.device)
    check(
        out.shape == (T, H, d_v) and out.stride(2) == 1,
        f"out: expected [{T}, {H}, {d_v}] with contiguous last dim",
    )
    bd = _block_d(a, block_d)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse

    bh = block_h or max(16, min(64, triton.next_power_of_2(H)))
    n_hb = triton.cdiv(H, bh)
    KA = main.indices.shape[1]
    KB = extra.indices.shape[1] if extra is not None else 0
    total = max(KA + KB, 1)
    if split_keys is not None:
        check(num_splits is None, "split_keys and num_splits exclude each other")
        check(
            split_keys > 0 and split_keys % block_n == 0,
            f"split_keys: a positive multiple of block_n={block_n}, got {split_keys}",
        )
        chunk = split_keys
    else:
        if num_splits is None:
            want = max(1, triton.cdiv(2 * _num_sms(q.device), T * n_hb))
            # >= 256 keys per split: a split writes h * d_v * 4 B of partials (128 KiB at h = 64)
            num_splits = min(want, triton.cdiv(total, max(256, block_n)))
        chunk = triton.cdiv(triton.cdiv(total, num_splits), block_n) * block_n
    num_splits = triton.cdiv(total, chunk)
    # batch-invariant mode never takes the one-split shortcut: it rounds differently from the combine pass
    single = num_splits == 1 and split_keys is None
    if single:
        part = plse = lse
    else:
        part = torch.empty(T, num_splits, H, d_v, dtype=torch.float32, device=q.device)
        plse = torch.empty(T, num_splits, H, dtype=torch.float32, device=q.device)

    ex = extra if extra is not None else main
    gb = ex.geom
    dummy_len = main.indices  # never read when HAS_L* is False
    nw = num_warps or (8 if bh >= 64 else 4)
    common = dict(
        HAS_B=extra is not None,
        HAS_LA=main.lengths is not None,
        HAS_LB=extra is not None and extra.lengths is not None,
        HAS_SINK=sink is not None,
        SINGLE=single,
        BH=bh,
        BN=block_n,
        DT=dot_dtype(q.dtype == torch.float32),
        num_warps=nw,
        num_stages=num_stages or (STAGES_FP32 if q.dtype == torch.float32 else STAGES),
    )
    # the kernel reads the extra pool through the main pool's views, at this byte distance
    b_delta = ex.pool.data_ptr() - main.pool.data_ptr()
    check(b_delta % 4 == 0, "pools: base addresses must be 4-byte aligned")
    LAST_COMPILED["split"] = sparse_attn_split_kernel[(n_hb, T, num_splits)](
        q,
        q.stride(0),
        q.stride(1),
        H,
        chunk,
        main.indices,
        main.indices.stride(0),
        main.lengths if main.lengths is not None else dummy_len,
        KA,
        *pool_views(main.pool),
        a.page_size,
        a.page_bytes,
        a.data_stride,
        a.scale_base,
        a.scale_stride,
        ex.indices,
        ex.indices.stride(0),
        ex.lengths if ex.lengths is not None else dummy_len,
        KB,
        b_delta,
        gb.page_size,
        gb.page_bytes,
        gb.data_stride,
        gb.scale_base,
        gb.scale_stride,
        sink if sink is not None else lse,
        float(sm_scale),
        out,
        out.stride(0),
        out.stride(1),
        lse,
        part,
        plse,
        num_splits,
        KIND=a.kind,
        MAIN=a.main,
        MAIN_P=a.main_p,
        NOPE=a.nope,
        TILE=a.tile,
        TAIL=a.tail,
        TAIL_P=a.tail_p,
        TAIL_OFF=a.tail_off,
        V_TAIL=v_tail,
        DC=bd,
        **common,
    )
    if not single:
        sparse_attn_combine_kernel[(T, H)](
            part,
            plse,
            num_splits,
            H,
            sink if sink is not None else lse,
            out,
            out.stride(0),
            out.stride(1),
            lse,
            DV=d_v,
            DV_P2=triton.next_power_of_2(d_v),
            HAS_SINK=sink is not None,
            num_warps=4,
        )
    return out, lse * LN2


def flashmla_sparse_attention(
    q: torch.Tensor,
    main: Scope,
    extra: Scope | None = None,
    *,
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,
    sched_meta=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same call served by FlashMLA's sparse decode (sgl-flash-mla, legacy SM90 kernels).

    Fits when both pools are HCA_FP8 (V4 layout, D = 512) or the main pool is MLA_FP8 (V3.2 layout,
    D = 576), h in {64, 128} (pad heads first), d_v = 512. Returns (out [T, h, 512] bf16, lse [T, h]).
    Top-k widths must be multiples of 64 for FlashMLA (pad with -1). The V3.2 kernel takes no lengths
    (``main.lengths`` is ignored for MLA_FP8): entries past a row's length must be -1. Lengths are clamped to >= 1
    (as SGLang's c128_topk_lengths_clamp1): a row of length 0 must hold -1 in its first entry.
    """
    import flash_mla

    L = main.geom.layout
    check(L in (KVLayout.HCA_FP8, KVLayout.MLA_FP8), f"FlashMLA reads no {L.value} pool")
    T, H, D = q.shape
    check(H in (64, 128), f"FlashMLA needs 64 or 128 heads, got {H}")
    kv_format = "V32" if L is KVLayout.MLA_FP8 else None
    kc = main.geom.flashmla_view(main.pool)
    args = dict(
        q=q.view(T, 1, H, D),
        k_cache=kc,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=d_v,
        tile_scheduler_metadata=sched_meta if sched_meta is not None else flash_mla.get_mla_metadata()[0],
        softmax_scale=sm_scale,
        is_fp8_kvcache=True,
        indices=main.indices.view(T, 1, -1),
        topk_length=None if main.lengths is None or kv_format == "V32" else main.lengths.clamp_min(1),
        attn_sink=sink,
        use_legacy=True,
        kv_format=kv_format,
    )
    if extra is not None:
        args.update(
            extra_k_cache=extra.geom.flashmla_view(extra.pool),
            extra_indices_in_kvcache=extra.indices.view(T, 1, -1),
            extra_topk_length=None if extra.lengths is None else extra.lengths.clamp_min(1),
        )
    o, lse = flash_mla.flash_mla_with_kvcache(**args)
    return o.view(T, H, d_v), lse.view(T, H)
