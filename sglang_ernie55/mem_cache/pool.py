"""`Ernie55TokenToKVPool`: the KV pool of ERNIE-5.5 (docs/serving-design.md section 4).

Per HCA layer: window kv rows at the full-pool slot `loc`, compressed entries at `loc // ratio`
(two per 256-token page, plus one scratch row), and the request-scoped open-block state
`[req slot (+1 scratch), ratio, 2 * head_dim]` fp32. Per MLA-DSA layer: `[latent | k_pe]` and the
indexer key at `loc`. Row 0 .. page_size-1 of every token-addressed buffer is SGLang's padding page.

KV dtypes `bfloat16` and `fp8_e4m3`: every buffer is a paged uint8 pool in the byte layout of
`sglang_ernie55.kernels.layout` (HCA_FP8 = SGLang's V4 layout, MLA_FP8 = FlashMLA's V3.2 layout,
IDX_FP8; or the bf16 layouts), written and read through the byte-exact torch twins of helper-4's
kernels (`PackedRows`), so the Triton kernels can take over reads and writes without a layout change.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..configuration import LAYER_HCA
from ..kernels.layout import KVLayout, hca_geometry, idx_geometry, mla_geometry
from ..reference import kernels_ref as kref


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.uint8)


class PackedRows:
    """Token rows in one paged uint8 pool with the byte layout of `sglang_ernie55.kernels.layout`
    (`Geometry`): what helper-4's Triton kernels (kv_store, sparse attention, compression) read and
    write. Stage 1 encodes / decodes with their byte-exact torch twins (`reference.kernels_ref`), which
    have static shapes (CUDA-graph safe)."""

    def __init__(self, geom, rows: int, device):
        self.geom = geom
        self.rows = rows
        self.num_pages = -(-rows // geom.page_size)
        self.pool = geom.alloc(self.num_pages, device=device)
        self.width = (
            geom.dim + geom.rope if geom.layout in (KVLayout.MLA_FP8, KVLayout.MLA_BF16) else geom.dim
        )

    def buffers(self) -> list[torch.Tensor]:
        return [self.pool]

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        """Rows `x` [n, width] into slots `loc` [n]."""
        kref.pool_store(self.pool, self.geom, loc.reshape(-1).long(), x.float().contiguous())

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        """Rows at `loc` (any shape) -> fp32 [*loc.shape, width]."""
        return kref.pool_gather(self.pool, self.geom, loc.reshape(-1).long()).view(*loc.shape, self.width)


class DenseRows:
    """Unquantized rows (fp32 or bf16) in a plain [rows, width] tensor: the exactness-test storage
    (a pool built with dtype float32), never what `--kv-cache-dtype` selects."""

    def __init__(self, rows: int, width: int, device, dtype: torch.dtype = torch.float32):
        self.rows, self.width = rows, width
        self.data = torch.zeros(rows, width, dtype=dtype, device=device)

    def buffers(self) -> list[torch.Tensor]:
        return [self.data]

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        self.data[loc.reshape(-1).long()] = x.to(self.data.dtype)

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        return self.data[loc.reshape(-1).long()].float().view(*loc.shape, self.width)


class OwnRowsKVSurface:
    """SGLang's generic per-layer KV accessors, refused: our pools are read and written only through their
    own layer-typed rows by our backends. `_ACCESS_NOTE` names who does that in the error."""

    _ACCESS_NOTE = "the ernie55 backend reads and writes the pool through its own layer-typed buffers"

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"{type(self).__name__}: {what} is not supported ({self._ACCESS_NOTE}; "
            "HiCache/PD/generic KV access are a later stage)"
        )

    def get_key_buffer(self, layer_id: int):
        self._unsupported("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._unsupported("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._unsupported("get_kv_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        self._unsupported("set_kv_buffer")


class Ernie55TokenToKVPool(OwnRowsKVSurface, KVCache):
    """Hybrid HCA / MLA-DSA pool addressed by SGLang's full-pool slots (stage 1: window kept per token)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, config, num_req_slots: int, device: str,
                 enable_memory_saver: bool = False, start_layer: int | None = None,
                 end_layer: int | None = None) -> None:  # fmt: skip
        super().__init__(size, page_size, dtype, config.num_hidden_layers, device, enable_memory_saver,
                         start_layer, end_layer)  # fmt: skip
        c = config
        if page_size % c.compress_ratio:
            raise ValueError(f"page size {page_size} must be a multiple of compress_ratio {c.compress_ratio}")
        fp8 = is_fp8(dtype)
        dense = dtype == torch.float32  # exactness tests only
        kv = "fp8_e4m3" if fp8 else "bfloat16"
        self.config, self.fp8, self.kv_dtype, self.dense = config, fp8, kv, dense
        self.ratio, self.window = c.compress_ratio, c.window_size
        self.token_rows = size + page_size
        cmp_page = page_size // self.ratio
        # + one scratch entry (padded CUDA-graph rows write there), rounded up to whole compressed pages
        self.cmp_rows = -(-(self.token_rows // self.ratio + 1) // cmp_page) * cmp_page
        self.cmp_scratch = self.cmp_rows - 1
        self.num_req_slots = num_req_slots
        self.state_scratch = num_req_slots  # + scratch slot
        self.win: dict = {}
        self.cmp: dict = {}
        self.state: dict[int, torch.Tensor] = {}
        self.latent: dict = {}
        self.index_k: dict = {}
        D, r, R, dI = c.head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.index_head_dim
        for lid, kind in enumerate(c.layer_types):
            if kind == LAYER_HCA:
                if dense:
                    self.win[lid] = DenseRows(self.token_rows, D, device)
                    self.cmp[lid] = DenseRows(self.cmp_rows, D, device)
                else:
                    self.win[lid] = PackedRows(hca_geometry(kv, D, r, page_size), self.token_rows, device)
                    self.cmp[lid] = PackedRows(hca_geometry(kv, D, r, cmp_page), self.cmp_rows, device)
                self.state[lid] = torch.zeros(num_req_slots + 1, self.ratio, 2 * D, dtype=torch.float32,
                                              device=device)  # fmt: skip
            elif dense:
                self.latent[lid] = DenseRows(self.token_rows, R + r, device)
                self.index_k[lid] = DenseRows(self.token_rows, dI, device)
            else:
                self.latent[lid] = PackedRows(mla_geometry(kv, R, r, page_size), self.token_rows, device)
                self.index_k[lid] = PackedRows(idx_geometry(kv, dI, page_size), self.token_rows, device)
        self._finalize_allocation_log(size)

    # ------------------------------------------------------------------ SGLang KVCache surface
    def _all_buffers(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = list(self.state.values())
        for d in (self.win, self.cmp, self.latent, self.index_k):
            for codec in d.values():
                out += codec.buffers()
        return out

    def get_kv_size_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._all_buffers())
