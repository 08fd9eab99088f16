"""HCA compression: each complete block of R = compress_ratio tokens -> one entry of the compressed pool
(`hca_compress_store`), and the update of the open-block state ring (`hca_state_update`). Per layer and
batch the store runs first (it reads the state rows of the blocks that complete), then the update. R: any
divisor of the page size; head / rope widths: any even ones. The ring: docs/kv-layout.md.
"""

from __future__ import annotations

import torch
import triton

from ..configuration import SERVING_PAGE_SIZE
from ._pool import check, check_pool, pool_args, pool_views
from ._triton.hca_compress import hca_compress_kernel, hca_state_update_kernel
from .layout import Geometry, KVLayout

# dtypes of the compressor rows `kvs` the kernels read (as fp32)
KVS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_ratio(ratio: int) -> None:
    check(
        isinstance(ratio, int) and 1 <= ratio <= SERVING_PAGE_SIZE and SERVING_PAGE_SIZE % ratio == 0,
        f"compress ratio: a divisor of the page size {SERVING_PAGE_SIZE}, got {ratio}",
    )


def hca_compress_store(
    pool: torch.Tensor,
    g: Geometry,
    kvs: torch.Tensor,
    state: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    job_req_slot: torch.Tensor,
    job_block: torch.Tensor,
    job_ext_start: torch.Tensor,
    job_tok_start: torch.Tensor,
    job_out_slot: torch.Tensor,
) -> None:
    """Compress J blocks (one program each; a job with out_slot -1 is skipped, so J may be padded):

        cmp_j = RoPE_interleaved(RMSNorm(sum_t softmax_t(s_t + ape_t) * c_t; norm_w, eps), position R j)

    over the rows [c_t | s_t] (t < R) of block j (softmax per channel), stored at the job's slot in the
    pool's encoding. Row t comes from ``kvs`` when its position >= the request's first new position, else
    from ``state``. Reference: `kernels_ref.hca_compress_jobs`.

    pool:   compressed pool, uint8 [pages, g.page_bytes]; g = hca_geometry(dtype, D, rope, page_size=page size // R).
    kvs:    [N, 2D] wkv_gate output of the batch's new tokens ([values | scores]), flat over requests: fp32,
            bf16 or fp16 (read as fp32: the values the layer's fp32 upcast would give), rows may be strided
            (a column slice of the layer's merged projection), last dim contiguous.
    state:  fp32 [req_slots, ring, 2D] (layout.hca_state_alloc), ring = R or 2R, last dim contiguous;
            block j's row t is read from ring row (R j) % ring + t.
    ape:    fp32 [R, D] contiguous: its rows give the compress ratio R; norm_w fp32 [D]; cos, sin fp32
            [max_pos, rope/2] (rope.cos_sin of arange(max_pos)), row-contiguous, covering position R * block.
    job_*:  int32/int64 [J]: request state slot, block index j, the request's first new position
            (prefix length), the flat kvs row of that position, and the compressed slot to write
            (-1: no job). Rows Rj..Rj+R-1 with position >= ext_start must be in kvs at
            tok_start + position - ext_start.
    """
    a = pool_args(g)
    check(g.layout in (KVLayout.HCA_FP8, KVLayout.HCA_BF16), f"pool: an HCA layout, got {g.layout.value}")
    check_pool(pool, g, "hca_compress_store.pool")
    D = g.dim
    check(ape.dim() == 2 and ape.shape[1] == D, f"ape: fp32 [ratio, {D}], got {tuple(ape.shape)}")
    R = ape.shape[0]
    _check_ratio(R)
    check(
        kvs.dim() == 2 and kvs.shape[1] == 2 * D and kvs.dtype in KVS_DTYPES and kvs.stride(1) == 1,
        f"kvs: fp32 / bf16 / fp16 [N, {2 * D}] with contiguous last dim, got {kvs.dtype} {tuple(kvs.shape)}",
    )
    check(
        state.dim() == 3
        and state.shape[1] in (R, 2 * R)
        and state.shape[2] == 2 * D
        and state.dtype == torch.float32
        and state.stride(2) == 1,
        f"state: fp32 [slots, {R} or {2 * R} (ring of 1 or 2 blocks), {2 * D}], got {state.dtype} "
        f"{tuple(state.shape)}",
    )
    check(
        ape.shape == (R, D) and ape.dtype == torch.float32 and ape.is_contiguous(),
        f"ape: fp32 [{R}, {D}] contiguous",
    )
    check(
        norm_w.shape == (D,) and norm_w.dtype == torch.float32 and norm_w.is_contiguous(),
        f"norm_w: fp32 [{D}]",
    )
    half = g.rope // 2
    for n, t in (("cos", cos), ("sin", sin)):
        check(
            t.dim() == 2 and t.shape[1] == half and t.dtype == torch.float32 and t.stride(1) == 1,
            f"{n}: fp32 [max_pos, {half}], got {t.dtype} {tuple(t.shape)}",
        )
    check(cos.stride(0) == sin.stride(0), "cos and sin: same row stride")
    J = job_out_slot.shape[0]
    for n, t in (
        ("job_req_slot", job_req_slot),
        ("job_block", job_block),
        ("job_ext_start", job_ext_start),
        ("job_tok_start", job_tok_start),
        ("job_out_slot", job_out_slot),
    ):
        check(
            t.shape == (J,) and t.dtype in (torch.int32, torch.int64) and t.is_contiguous(), f"{n}: int [{J}]"
        )
    if J == 0:
        return
    hca_compress_kernel[(J,)](
        kvs,
        kvs.stride(0),
        state,
        state.stride(0),
        state.stride(1),
        ape,
        norm_w,
        cos,
        sin,
        cos.stride(0),
        job_req_slot,
        job_block,
        job_ext_start,
        job_tok_start,
        job_out_slot,
        float(eps),
        state.shape[1],
        *pool_views(pool),
        a.page_size,
        a.page_bytes,
        a.data_stride,
        a.scale_base,
        a.scale_stride,
        D=D,
        HALF_P=a.main_p // 2,
        ROPE=g.rope,
        RATIO=R,
        RB=min(16, R),
        KIND=a.kind,
        NOPE=a.nope,
        TILE=a.tile,
        SCALE_BYTES=g.scale_stride if a.kind == 1 else 0,
        num_warps=4,
    )


def hca_state_update(
    state: torch.Tensor,
    kvs: torch.Tensor,
    positions: torch.Tensor,
    req_slot: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    ratio: int,
) -> None:
    """state[req_slot[i], positions[i] % ring] = kvs[i] for each new token i whose block is one of the
    request's last ``blocks = ring // ratio`` blocks at the end of the batch, i.e.
    positions[i] >= ratio * (seq_lens[i] // ratio - blocks + 1) (ring = ratio: the open block; 2 * ratio: the
    open block and the one before it, which a rejected draft may need to recompute); req_slot -1 skips.

    state fp32 [slots, ring, 2D], ring = ratio or 2 * ratio; kvs [N, 2D] as `hca_compress_store` takes it
    (stored as fp32); positions, req_slot, seq_lens
    int [N] (per token: its position, its request's state slot, its request's sequence length after this
    batch); ratio: the layer's compress ratio (a divisor of the page size). Within one request the
    written positions span at most ``ring`` consecutive values (distinct rows)."""
    N = kvs.shape[0]
    _check_ratio(ratio)
    R = ratio
    check(
        state.dim() == 3 and state.shape[1] in (R, 2 * R) and state.stride(2) == 1,
        f"state: [slots, {R} or {2 * R} (ring of 1 or 2 blocks), 2D], got {tuple(state.shape)}",
    )
    check(
        kvs.shape == (N, state.shape[2])
        and kvs.dtype in KVS_DTYPES
        and state.dtype == torch.float32
        and kvs.stride(1) == 1,
        f"kvs: fp32 / bf16 / fp16 [N, {state.shape[2]}] with contiguous last dim (state fp32)",
    )
    for n, t in (("positions", positions), ("req_slot", req_slot), ("seq_lens", seq_lens)):
        check(
            t.shape == (N,) and t.dtype in (torch.int32, torch.int64) and t.is_contiguous(), f"{n}: int [{N}]"
        )
    W = state.shape[2]
    if N == 0:
        return
    hca_state_update_kernel[(N,)](
        kvs,
        kvs.stride(0),
        state,
        state.stride(0),
        state.stride(1),
        positions,
        req_slot,
        seq_lens,
        W=W,
        W_P=triton.next_power_of_2(W),
        RATIO=R,
        RING=state.shape[1],
        num_warps=4,
    )


def plan_compress_jobs(
    prefix_lens: list[int], seq_lens: list[int], req_slots: list[int], cmp_slot, device=None, *, ratio: int
) -> tuple[torch.Tensor, ...]:
    """Host-side job list for a batch (extend or decode): every block j with ratio * (j+1) in
    (prefix_len, seq_len]. ``cmp_slot(request index, j)`` gives the compressed slot.
    Returns (job_req_slot, job_block, job_ext_start, job_tok_start, job_out_slot) int32 tensors."""
    rows = []
    tok = 0
    for r, (p, L, s) in enumerate(zip(prefix_lens, seq_lens, req_slots)):
        for j in range(p // ratio, L // ratio):
            if ratio * (j + 1) > p:
                rows.append((s, j, p, tok, cmp_slot(r, j)))
        tok += L - p
    t = torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 5)
    return tuple(t[:, k].contiguous() for k in range(5))
