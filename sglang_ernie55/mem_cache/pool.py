"""`Ernie55TokenToKVPool`: the KV pool of ERNIE-5.5 (docs/serving-design.md section 4).

Per HCA layer: window kv rows at the full-pool slot `loc`, compressed entries at `loc // ratio`
(two per 256-token page, plus one scratch row), and the request-scoped open-block state
`[req slot (+1 scratch), ratio, 2 * head_dim]` fp32. Per MLA-DSA layer: `[latent | k_pe]` and the
indexer key at `loc`. Row 0 .. page_size-1 of every token-addressed buffer is SGLang's padding page.

KV dtypes: `bfloat16` (rows stored as bf16) and `fp8_e4m3` (the quantisation rules of
`sglang_ernie55.kernels.layout`: HCA e4m3 with one ue8m0 scale per 64-value tile and a bf16 rope
tail; MLA e4m3 latent with one fp32 scale per 128-value tile and a bf16 rope tail; indexer key e4m3
with one fp32 scale per token). Stage 1 keeps codes, scales and rope tails in separate tensors
(`RowCodec`); the packed byte layout of `kernels/layout.py` replaces them with the Triton kernels.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..configuration import LAYER_HCA

FP8_MAX = 448.0
FP8_AMAX_EPS = 1e-8
HCA_FP8_TILE = 64
MLA_FP8_TILE = 128


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.uint8)


class RowCodec:
    """Rows of `dim` values (the last `rope` kept bf16) stored in bf16, or in e4m3 with per-tile scales.

    fp8: the first `dim - rope` values in tiles of `tile`; scale per tile = amax / 448 (fp32), or its
    next power of two (`ue8m0`); code = e4m3(clamp(x / scale, +-448)); value = code * scale.
    """

    def __init__(self, rows: int, dim: int, rope: int, fp8: bool, tile: int, ue8m0: bool, device,
                 store_dtype: torch.dtype = torch.bfloat16):  # fmt: skip
        self.rows, self.dim, self.rope, self.fp8, self.ue8m0 = rows, dim, rope, fp8, ue8m0
        self.store_dtype = store_dtype
        self.nope = dim - rope
        if fp8:
            tile = min(tile, self.nope)
            if self.nope % tile:
                raise ValueError(f"fp8 KV rows need (dim - rope) = {self.nope} divisible by the tile {tile}")
            self.tile, self.ntiles = tile, self.nope // tile
            self.codes = torch.zeros(rows, self.nope, dtype=torch.uint8, device=device)
            self.scales = torch.ones(rows, self.ntiles, dtype=torch.float32, device=device)
            self.rope_tail = torch.zeros(rows, rope, dtype=torch.bfloat16, device=device)
        else:
            self.data = torch.zeros(rows, dim, dtype=store_dtype, device=device)

    def buffers(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, self.rope_tail] if self.fp8 else [self.data]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def bytes_per_row(self) -> int:
        return self.nbytes() // self.rows

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.float()
        if not self.fp8:
            return (x.to(self.store_dtype),)
        xn = x[:, : self.nope].reshape(-1, self.ntiles, self.tile)
        amax = xn.abs().amax(-1).clamp_min(FP8_AMAX_EPS)
        s = amax / FP8_MAX
        if self.ue8m0:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        q = (xn / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).reshape(-1, self.nope), s, x[:, self.nope :].to(torch.bfloat16)

    def write(self, loc: torch.Tensor, x: torch.Tensor) -> None:
        """Rows `x` [n, dim] into slots `loc` [n] (fixed shapes: CUDA-graph safe)."""
        loc = loc.long()
        for buf, val in zip(self.buffers(), self.encode(x)):
            buf[loc] = val

    def read(self, loc: torch.Tensor) -> torch.Tensor:
        """Rows at `loc` (any shape) -> fp32 [*loc.shape, dim]."""
        shape, loc = loc.shape, loc.reshape(-1).long()
        if not self.fp8:
            return self.data[loc].float().view(*shape, self.dim)
        q = self.codes[loc].view(torch.float8_e4m3fn).float().view(-1, self.ntiles, self.tile)
        xn = (q * self.scales[loc][..., None]).view(-1, self.nope)
        return torch.cat([xn, self.rope_tail[loc].float()], -1).view(*shape, self.dim)


class Ernie55TokenToKVPool(KVCache):
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
        # bf16 for `--kv-cache-dtype bfloat16`; fp32 rows only for exactness tests of the torch twin
        sd = torch.float32 if dtype == torch.float32 else torch.bfloat16
        self.config, self.fp8 = config, fp8
        self.ratio, self.window = c.compress_ratio, c.window_size
        self.token_rows = size + page_size
        self.cmp_rows = self.token_rows // self.ratio + 1  # + scratch row
        self.cmp_scratch = self.cmp_rows - 1
        self.num_req_slots = num_req_slots
        self.state_scratch = num_req_slots  # + scratch slot
        self.win: dict[int, RowCodec] = {}
        self.cmp: dict[int, RowCodec] = {}
        self.state: dict[int, torch.Tensor] = {}
        self.latent: dict[int, RowCodec] = {}
        self.index_k: dict[int, RowCodec] = {}
        for lid, kind in enumerate(c.layer_types):
            if kind == LAYER_HCA:
                D, r = c.head_dim, c.qk_rope_head_dim
                self.win[lid] = RowCodec(self.token_rows, D, r, fp8, HCA_FP8_TILE, True, device, sd)
                self.cmp[lid] = RowCodec(self.cmp_rows, D, r, fp8, HCA_FP8_TILE, True, device, sd)
                self.state[lid] = torch.zeros(num_req_slots + 1, self.ratio, 2 * D, dtype=torch.float32,
                                              device=device)  # fmt: skip
            else:
                R, r, dI = c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim
                self.latent[lid] = RowCodec(self.token_rows, R + r, r, fp8, MLA_FP8_TILE, False, device, sd)
                self.index_k[lid] = RowCodec(self.token_rows, dI, 0, fp8, dI, False, device, sd)
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

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"Ernie55TokenToKVPool: {what} is not supported (the ernie55 backend reads and writes the pool "
            "through its own layer-typed buffers; HiCache/PD/generic KV access are a later stage)"
        )

    def get_key_buffer(self, layer_id: int):
        self._unsupported("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._unsupported("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._unsupported("get_kv_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        self._unsupported("set_kv_buffer")
