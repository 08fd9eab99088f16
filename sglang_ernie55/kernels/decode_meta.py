"""The index rows of a fixed-shape batch (decode: one new token per request; target verify: S+1), built by one
Triton launch (`_triton/decode_meta.py`) where `KernelPath.fixed_meta` spends ~80 torch ops: the page table,
the window and compressed index rows with their lengths (`hca_meta.hca_indices`), the window-pool slots
(`kernel_path.window_slots`), the compression jobs and the state-update rows. Reference: `fixed_meta` itself,
field for field (tests/kernels/test_decode_meta.py); graph safe (device work only, static shapes)."""

from __future__ import annotations

import torch
import triton

from ._pool import check
from ._triton.decode_meta import decode_meta_kernel

BLOCK_P = 128  # page-table columns per step
BLOCK_C = 256  # compressed-index columns per step


def decode_meta(
    req: torch.Tensor,
    seq_lens: torch.Tensor,
    loc: torch.Tensor,
    req_to_token: torch.Tensor,
    mapping: torch.Tensor | None,
    *,
    per_req: int,
    seq_add: int,
    window: int,
    ratio: int,
    page_size: int,
    cmp_width: int,
) -> dict[str, torch.Tensor]:
    """req / seq_lens [B]; loc [B * per_req] (int64); req_to_token [slots, width]; mapping: full -> window slots
    (None: the window rows live in the full pool). Lengths after the batch are seq_lens + seq_add. Returns the
    `KernelMeta` tensors by field name (`jobs` as a 5-tuple)."""
    B, dev = req.shape[0], req.device
    T = B * per_req
    check(loc.dim() == 1 and loc.shape[0] == T, f"decode_meta.loc: expected [{T}], got {tuple(loc.shape)}")
    check(loc.dtype == torch.int64, f"decode_meta.loc: int64, got {loc.dtype}")
    check(req_to_token.dim() == 2 and req_to_token.stride(1) == 1, "decode_meta.req_to_token: [slots, width]")
    check(page_size % ratio == 0, f"decode_meta: ratio {ratio} must divide the page size {page_size}")
    width = req_to_token.shape[1]
    n_pages = -(-width // page_size)
    nj = -(-per_req // ratio)
    i32 = dict(dtype=torch.int32, device=dev)
    out = dict(
        tok_req=torch.empty(T, **i32),
        tok_pos=torch.empty(T, **i32),
        win_loc=torch.empty(T, dtype=torch.int64, device=dev),
        page_table=torch.empty(B, n_pages, **i32),
        win_idx=torch.empty(T, window, **i32),
        win_len=torch.empty(T, **i32),
        cmp_idx=torch.empty(T, cmp_width, **i32),
        cmp_len=torch.empty(T, **i32),
        st_req=torch.empty(T, **i32),
        st_seq=torch.empty(T, **i32),
    )
    jobs = tuple(torch.empty(B * nj, **i32) for _ in range(5))
    out["jobs"] = jobs
    if B == 0:
        return out
    decode_meta_kernel[(B,)](
        req,
        seq_lens,
        loc,
        req_to_token,
        req_to_token.stride(0),
        width,
        mapping if mapping is not None else loc,
        out["tok_req"],
        out["tok_pos"],
        out["win_loc"],
        out["page_table"],
        n_pages,
        out["win_idx"],
        out["win_len"],
        out["cmp_idx"],
        cmp_width,
        out["cmp_len"],
        *jobs,
        out["st_req"],
        out["st_seq"],
        SEQ_ADD=seq_add,
        PER_REQ=per_req,
        NJ=nj,
        W=window,
        W_P=triton.next_power_of_2(window),
        RATIO=ratio,
        PAGE=page_size,
        HAS_MAP=mapping is not None,
        BLOCK_P=BLOCK_P,
        BLOCK_C=BLOCK_C,
        num_warps=4,
    )
    return out
