"""`Ernie55TokenToKVPool`: the KV pool of ERNIE-5.5 (docs/serving-design.md section 4, docs/kv-layout.md), a
hybrid pool in SGLang's sense (`BaseSWAKVPool`) whose every buffer is a paged uint8 pool in the byte layout
of `sglang_ernie55.kernels.layout`, written and read through the byte-exact torch twins of the kernels
(`PackedRows`), so the Triton kernels read and write the same bytes.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

from ..kernels import torch_twin as twin
from ..kernels.layout import HCA_STATE_BLOCKS, KVLayout
from .sizing import DENSE_KV, Buffer, PoolLayout

logger = logging.getLogger(__name__)
POOL_LOG = "ERNIE-5.5 KV pool:"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.uint8)


class PackedRows:
    """Token rows in one paged uint8 pool with the byte layout of `sglang_ernie55.kernels.layout` (`Geometry`),
    read and written here through the byte-exact torch codecs of `kernels.torch_twin` (static shapes,
    CUDA-graph safe); the Triton kernels read and write the same bytes."""

    def __init__(self, buf: Buffer, device):
        self.geom = buf.geom
        self.rows = buf.rows
        self.pool = buf.alloc(device)
        self.num_pages = self.pool.shape[0]
        g = self.geom
        self.width = g.dim + g.rope if g.layout in (KVLayout.MLA_FP8, KVLayout.MLA_BF16) else g.dim

    def buffers(self) -> list[torch.Tensor]:
        return [self.pool]

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        """Rows `x` [n, width] into slots `loc` [n]."""
        twin.pool_store(self.pool, self.geom, loc.reshape(-1).long(), x.float().contiguous())

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        """Rows at `loc` (any shape) -> fp32 [*loc.shape, width]."""
        return twin.pool_gather(self.pool, self.geom, loc.reshape(-1).long()).view(*loc.shape, self.width)


class DenseRows:
    """Unquantized fp32 rows in a plain [rows, width] tensor: the exactness-test storage (a pool built with dtype
    float32), never what `--kv-cache-dtype` selects."""

    def __init__(self, buf: Buffer, device):
        self.data = buf.alloc(device)
        self.rows, self.width = self.data.shape

    def buffers(self) -> list[torch.Tensor]:
        return [self.data]

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        self.data[loc.reshape(-1).long()] = x.to(self.data.dtype)

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        return self.data[loc.reshape(-1).long()].float().view(*loc.shape, self.width)


def rows_of(buf: Buffer, device):
    """The row store of one pool buffer: packed layout or dense fp32."""
    return PackedRows(buf, device) if buf.geom is not None else DenseRows(buf, device)


class OwnRowsKVSurface:
    """SGLang's generic per-layer KV accessors, refused: our pools are read and written only through their
    own layer-typed rows by our backends. `_ACCESS_NOTE` names who does that in the error."""

    _ACCESS_NOTE = "the ernie55 backend reads and writes the pool through its own layer-typed buffers"

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"{type(self).__name__}: {what} is not supported ({self._ACCESS_NOTE}; "
            "generic KV access is not supported by this pool; PD transfers and HiCache move its pages through "
            "sglang_ernie55.mem_cache.pd_layout and sglang_ernie55.mem_cache.host_pool)"
        )

    def get_key_buffer(self, layer_id: int):
        self._unsupported("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._unsupported("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._unsupported("get_kv_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        self._unsupported("set_kv_buffer")


class SWAWindowAddressing:
    """Window rows addressed by SGLang's SWA slots: ONE translation, `window_loc`, for every window read
    and write (the target's HCA window rows, the ECHO draft's rows).

    In hybrid mode SGLang's `SWATokenToKVPoolAllocator` allocates an SWA slot for every full slot it hands
    out (page by page, in step with the full allocator: a full slot and its SWA slot share the offset in
    their 256-token pages) and frees the SWA slots of tokens that left the window; it registers
    `full_to_swa_index_mapping` [full size + page_size + 1] int64 with the pool (`register_mapping`): a
    freed or never-windowed slot maps to 0 (the SWA padding page), the trailing entry is -1, so -1 (FlashMLA's
    "no key") maps to -1. Without an SWA pool every translation is the identity."""

    full_to_swa_index_mapping: torch.Tensor | None = None

    def _init_window_addressing(self, full_size: int, page_size: int, swa_size: int | None) -> int:
        """Returns the number of window rows to allocate (+ the padding page)."""
        if swa_size is not None and (swa_size <= 0 or swa_size % page_size):
            raise ValueError(f"swa_size must be a positive multiple of page_size {page_size}, got {swa_size}")
        self.is_hybrid_swa = swa_size is not None
        self.swa_size = swa_size if swa_size is not None else full_size
        self.full_to_swa_index_mapping = None
        return self.swa_size + page_size

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Called by SGLang's SWA allocator (target pool) or KVCacheConfigurator (draft pool, the target
        allocator's mapping): the tensor is kept by reference, the allocator updates it in place."""
        m = full_to_swa_index_mapping
        want = self.size + self.page_size + 1
        if not self.is_hybrid_swa:
            raise ValueError(
                f"{type(self).__name__} was built without an SWA pool (swa_size=None) but SGLang registered a "
                "full->SWA mapping: the pool hook must pass sizes.swa_max_total_num_tokens in hybrid mode"
            )
        if m.dim() != 1 or m.numel() != want or m.dtype != torch.int64:
            raise ValueError(
                f"full_to_swa_index_mapping must be int64 [full size + page_size + 1] = [{want}], "
                f"got {m.dtype} {list(m.shape)}"
            )
        self.full_to_swa_index_mapping = m

    def window_loc(self, full_loc: torch.Tensor) -> torch.Tensor:
        """Full-pool slots (any shape; -1 = no key) -> window-row slots: the SWA slot in hybrid mode
        (a gather from the registered mapping: fixed shape, no host sync, CUDA-graph safe), else the same
        slots."""
        if not self.is_hybrid_swa:
            return full_loc
        m = self.full_to_swa_index_mapping
        if m is None:
            raise RuntimeError(
                f"{type(self).__name__}: the SWA pool has no full->SWA mapping yet (SGLang's "
                "SWATokenToKVPoolAllocator registers it when it is built)"
            )
        return m[full_loc.long()]

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SGLang's name for `window_loc` (BaseSWAKVPool)."""
        return self.window_loc(kv_indices)

    def window_pages(self, full_pages: torch.Tensor) -> torch.Tensor:
        """Full-pool page ids (any shape; negative = none, kept) -> the window pool's page ids, for
        kernels that build window slots as `page * page_size + pos % page_size` (kernels/hca_meta.py).
        Exact because SGLang's SWA allocator keeps offsets: `window_loc(f) == window_pages(f // P) * P
        + f % P` for every live full slot f (tests/serving/test_pool_cpu.py checks it on the real
        allocator). A page whose window rows were freed maps to page 0 (the padding page)."""
        if not self.is_hybrid_swa:
            return full_pages
        fp = full_pages.long()
        first = self.window_loc(fp.clamp_min(0) * self.page_size)
        swa = torch.div(first, self.page_size, rounding_mode="floor")
        return torch.where(fp >= 0, swa, fp).to(full_pages.dtype)


# SGLang's `SWATokenToKVPoolAllocator` hands out a full-pool slot `loc` and an SWA slot per token and registers
# its `full_to_swa_index_mapping` here. Per HCA layer: window kv rows at the SWA slot `window_loc(loc)`
# (`swa_size + page_size` rows), compressed entries at `loc // ratio`, and the request-scoped open-block state
# `[req slot (+1 scratch), state_blocks * ratio, 2 * head_dim]` fp32, a ring (token p at row
# `p % (state_blocks * ratio)`): two blocks when speculating, so a rejected draft past a block boundary does
# not overwrite the block it would complete. Per MLA-DSA layer: `[latent | k_pe]` and the indexer key at
# `loc`. Row 0 .. page_size-1 of every token-addressed buffer is the padding page (the SWA side too).
# Without an SWA pool (`--disable-hybrid-swa-memory`) the window rows sit at the full slot.
class Ernie55TokenToKVPool(SWAWindowAddressing, OwnRowsKVSurface, BaseSWAKVPool):
    """Hybrid HCA / MLA-DSA pool: full-pool slots for compressed entries, MLA latents and indexer keys; SWA
    slots (`window_loc`) for the HCA window rows."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        config,
        num_req_slots: int,
        device: str,
        enable_memory_saver: bool = False,
        start_layer: int | None = None,
        end_layer: int | None = None,
        swa_size: int | None = None,
        state_blocks: int = HCA_STATE_BLOCKS,
    ) -> None:
        super().__init__(
            size,
            page_size,
            dtype,
            config.num_hidden_layers,
            device,
            enable_memory_saver,
            start_layer,
            end_layer,
        )
        c = config
        self.layout = PoolLayout(c, dtype, page_size, state_blocks)
        self.config, self.fp8 = config, is_fp8(dtype)
        self.dense = self.layout.kv == DENSE_KV  # exactness tests only
        self.kv_dtype = "fp8_e4m3" if self.fp8 else "bfloat16"
        self.ratio, self.window = c.compress_ratio, c.window_size
        self.token_rows = self.layout.token_rows(size)
        self.window_rows = self._init_window_addressing(size, page_size, swa_size)
        self.cmp_rows = self.layout.cmp_rows(size)
        self.cmp_scratch = self.cmp_rows - 1  # padded CUDA-graph rows write their entries there
        self.state_blocks = state_blocks
        self.state_ring = self.layout.state_ring  # rows per request slot; token p at row p % state_ring
        self.num_req_slots = num_req_slots
        self.state_scratch = num_req_slots  # + scratch slot
        self.win: dict = {}
        self.cmp: dict = {}
        self.state: dict[int, torch.Tensor] = {}
        self.latent: dict = {}
        self.index_k: dict = {}
        stores = {"window": self.win, "compressed": self.cmp, "latent": self.latent, "index": self.index_k}
        for buf in self.layout.buffers(size, swa_size, num_req_slots):
            if buf.name == "state":
                self.state[buf.layer] = buf.alloc(device)
            else:
                stores[buf.name][buf.layer] = rows_of(buf, device)
        self._finalize_allocation_log(size)
        logger.info(
            f"{POOL_LOG} full_tokens={size} swa_tokens={self.swa_size if self.is_hybrid_swa else None} "
            f"window_rows={self.window_rows} hca_layers={len(self.win)} mla_layers={len(self.latent)} "
            f"kv={self.layout.kv} bytes={self.get_kv_size_bytes()}"
        )

    # ------------------------------------------------------------------ SGLang KVCache surface
    def _all_buffers(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(self.state.values())
        for d in (self.win, self.cmp, self.latent, self.index_k):
            for codec in d.values():
                out += codec.buffers()
        return out

    def get_kv_size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._all_buffers())

    # ------------------------------------------------------------------ PD transfer (mem_cache/pd_layout.py)
    def get_contiguous_buf_infos(self):
        """PD KV data: the full-page-addressed buffers (compressed entries, latents, indexer keys)."""
        from .pd_layout import contiguous_buf_infos

        return contiguous_buf_infos(self)

    def get_state_buf_infos(self):
        """PD `StateType.SWA`: the HCA window rows at SWA pages (none without an SWA pool)."""
        from .pd_layout import state_buf_infos

        return state_buf_infos(self)

    def get_request_state_buf_infos(self):
        """PD `StateType.DSV4_REQUEST_STATE`: the HCA open-block state, one item per position row."""
        from .pd_layout import request_state_buf_infos

        return request_state_buf_infos(self)

    def request_state_transfer_indices(self, req_pool_idx: int, seq_len: int):
        """The open-block state rows of one request (SGLang asks both PD servers)."""
        from .pd_layout import request_state_rows

        return request_state_rows(self, req_pool_idx, seq_len)

    def wait_layer_transfer(self, layer_id: int) -> None:
        """Holds this layer's reads until HiCache's host-to-device load of its pages is done: SGLang's per-layer
        counter, which the HiCache controller registers with the pool (None without HiCache)."""
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)
