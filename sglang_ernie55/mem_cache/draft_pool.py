"""The ECHO draft's KV pool: the window rows of one layer (the target's last), nothing else, addressed like
the target's window rows (SGLang's EAGLE draft worker shares the target's `req_to_token` and allocator).
Bytes per token: `echo_bytes_per_token`, reserved per SWA token by the target's pool configurator.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..configuration import SERVING_PAGE_SIZE
from .pool import OwnRowsKVSurface, SWAWindowAddressing, is_fp8, rows_of
from .sizing import PoolLayout


def echo_bytes_per_token(config, kv_dtype: torch.dtype, page_size: int = SERVING_PAGE_SIZE) -> float:
    """Draft KV bytes per SWA token, page padding included (what the target's pool configurator reserves for
    ECHO): full size, HCA fp8 585 B (584 B/token + the V4 page padding), bf16 1024 B."""
    return PoolLayout(config, kv_dtype, page_size, echo=True).draft_row


# Rows sit at the SWA slot `window_loc(loc)` of the target's `SWATokenToKVPoolAllocator` (SGLang registers its
# `full_to_swa_index_mapping` with the draft pool too, as DSV4's SWA-only draft pool), or at the full slot
# without an SWA pool; row 0 .. page_size-1 is the padding page. HCA last layer: the normed, roped kv row per
# token in the target's window layout (no compressed entries, no open-block state). MLA-DSA last layer:
# `[latent | k_pe]` per token, no indexer keys. SGLang's SWA eviction frees rows that left the window, so the
# pool holds `swa_size + page_size` rows.
class EchoDraftKVPool(SWAWindowAddressing, OwnRowsKVSurface, KVCache):
    """One layer of per-token rows at `window_loc(loc)` (SWA slots of the target's allocator in hybrid mode);
    `layer_id` is the target's last layer (the draft runs that very module, whose RadixAttention carries that
    id). Storage as the target's window: a paged uint8 pool in the kernels/layout.py byte layout
    (`PackedRows`), or fp32 `DenseRows` for a pool built with dtype float32 (exactness tests only)."""

    _ACCESS_NOTE = "the ECHO draft backend reads and writes the pool through its own rows"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        config,
        device: str,
        enable_memory_saver: bool = False,
        swa_size: int | None = None,
    ) -> None:
        self.layer_id = config.num_hidden_layers - 1
        super().__init__(size, page_size, dtype, 1, device, enable_memory_saver, self.layer_id, self.layer_id)
        self.config = config
        self.kind = config.layer_types[-1]
        self.window = config.window_size
        self.fp8 = is_fp8(dtype)
        self.token_rows = self._init_window_addressing(size, page_size, swa_size)
        (buf,) = PoolLayout(config, dtype, page_size, echo=True).draft_buffers(size, swa_size)
        self.rows = rows_of(buf, device)
        self._finalize_allocation_log(size)

    def check_layer(self, layer_id: int):
        if layer_id != self.layer_id:
            raise ValueError(
                f"the ECHO draft pool holds layer {self.layer_id} (the target's last), not {layer_id}"
            )
        return self.rows

    # ------------------------------------------------------------------ SGLang KVCache surface
    def get_contiguous_buf_infos(self):
        """PD KV data of the draft: its rows when they sit at full slots (no SWA pool); with an SWA pool they
        go as an SWA state component (mem_cache/pd.py `around_setup_state_kv_args`)."""
        from .pd_layout import buf_infos, page_rows

        return ([], [], []) if self.is_hybrid_swa else buf_infos([page_rows(self.rows, self.page_size)])

    def get_state_buf_infos(self):
        from .pd_layout import state_buf_infos

        return state_buf_infos(self)

    def get_kv_size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.rows.buffers())
