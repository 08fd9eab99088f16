"""The PD transfer layout of the ERNIE-5.5 pools: the buffers SGLang's transfer engine moves, in its three
addressings (docs/serving-design.md section 10). Plain functions over a pool's attributes; the pools' PD methods
call them, and they import no pool class.
"""

from __future__ import annotations

import numpy as np
import torch

# The three addressings (SGLang component: index; our buffers per layer; item):
# - KV data (`get_contiguous_buf_infos`): the full-pool page of every prompt token; HCA compressed entries (page p =
#   the blocks of full page p), MLA-DSA latent + rope, MLA-DSA indexer keys (and the HCA window rows without an SWA
#   pool); one page.
# - `StateType.SWA` (`get_state_buf_infos`): the SWA page of the last `window` prompt tokens; HCA window rows; the
#   ECHO draft's rows as a second SWA component; one page.
# - `StateType.DSV4_REQUEST_STATE` (`get_request_state_buf_infos`): one row per position of the open compression
#   block; the HCA open-block state `[c | s]` fp32; one position's row. Each server computes its own row
#   `slot * ring + p % ring`, so the two may differ in request slot and in ring size (one block, or two when
#   speculating); a prompt that ends on a block boundary sends no state row.


def buf_infos(tensors) -> tuple[list[int], list[int], list[int]]:
    """(data pointers, byte lengths, item lengths) of `[items, item_bytes]` tensors."""
    ptrs, lens, items = [], [], []
    for t in tensors:
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(
                f"a PD transfer buffer must be a contiguous [items, bytes] tensor, got {list(t.shape)}"
            )
        ptrs.append(t.data_ptr())
        lens.append(t.numel() * t.element_size())
        items.append(t[0].numel() * t.element_size())
    return ptrs, lens, items


def page_rows(codec, rows_per_page: int) -> torch.Tensor:
    """A row store's tensor as `[pages, page_bytes]` uint8: a packed pool itself (`PackedRows.pool`), or the dense
    fp32 rows of an exactness-test pool (`DenseRows.data`) grouped `rows_per_page` to a page (the same bytes, no
    copy)."""
    if getattr(codec, "geom", None) is not None:
        if codec.geom.page_size != rows_per_page:
            raise ValueError(f"a packed page holds {codec.geom.page_size} rows, not {rows_per_page}")
        return codec.pool
    data = codec.data
    if data.shape[0] % rows_per_page:
        raise ValueError(f"{data.shape[0]} dense rows are not whole pages of {rows_per_page}")
    return data.view(torch.uint8).view(data.shape[0] // rows_per_page, -1)


def full_page_buffers(pool) -> list:
    """(name, layer, `[pages, page_bytes]` uint8 view) of the target pool's buffers addressed by full-pool page,
    layer by layer: HCA compressed entries (page p = the blocks of full page p), MLA-DSA latents and indexer keys;
    HCA window rows too when the pool has no SWA pool (they then sit at full slots)."""
    P = pool.page_size
    stores = [
        ("compressed", pool.cmp, P // pool.ratio),
        ("latent", pool.latent, P),
        ("index", pool.index_k, P),
    ]
    if not pool.is_hybrid_swa:
        stores.append(("window", pool.win, P))
    out = [
        (name, lid, page_rows(codec, rows)) for name, store, rows in stores for lid, codec in store.items()
    ]
    return sorted(out, key=lambda x: (x[1], x[0]))


def swa_page_buffers(pool) -> list:
    """The window rows at SWA slots (`[swa pages + 1, page_bytes]` uint8): one per HCA layer of the target pool,
    the one buffer of the ECHO draft pool (`rows`). Empty without an SWA pool."""
    if not pool.is_hybrid_swa:
        return []
    if hasattr(pool, "rows"):
        return [page_rows(pool.rows, pool.page_size)]
    return [page_rows(pool.win[lid], pool.page_size) for lid in sorted(pool.win)]


def contiguous_buf_infos(pool):
    return buf_infos(t for _, _, t in full_page_buffers(pool))


def state_buf_infos(pool):
    return buf_infos(swa_page_buffers(pool))


def request_state_buf_infos(pool):
    """The open-block state of every HCA layer, `[slots * ring, 2 * head_dim]` fp32 rows."""
    return buf_infos(pool.state[lid].view(-1, pool.state[lid].shape[-1]) for lid in sorted(pool.state))


def request_state_rows(pool, req_pool_idx: int, seq_len: int) -> np.ndarray:
    """State rows of the open block of a request of `seq_len` tokens in slot `req_pool_idx`: positions
    `ratio * floor(seq_len / ratio) .. seq_len - 1`, in position order (empty on a block boundary)."""
    if not 0 <= req_pool_idx < pool.num_req_slots:
        raise ValueError(f"req_pool_idx must be in [0, {pool.num_req_slots}), got {req_pool_idx}")
    start = seq_len // pool.ratio * pool.ratio
    positions = np.arange(start, seq_len, dtype=np.int64)
    return (req_pool_idx * pool.state_ring + positions % pool.state_ring).astype(np.int32)
