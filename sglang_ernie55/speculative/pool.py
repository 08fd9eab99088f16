"""The ECHO draft's KV pool: the window rows of one layer (the target's last), nothing else.

SGLang's EAGLE draft worker shares the target's `req_to_token` and token allocator, so the draft pool is
indexed by the same full-pool slots `loc` as the target's (row 0 .. page_size-1 = SGLang's padding page)
but holds only what the window-only draft attention reads (ARCHITECTURE.md convention 11):

- HCA last layer: the normed, roped kv row [head_dim] per token (same RowCodec as the target's window:
  bf16, or e4m3 + ue8m0 scale per 64 + bf16 rope tail). No compressed entries, no open-block state: the
  sink is a parameter of the shared layer.
- MLA-DSA last layer: `[latent | k_pe]` per token; no indexer keys (plain MLA over the window).

The draft attends only the `window_size` most recent positions, so a ring of W rows per request would
do; stage 1 keeps one row per full-pool slot, like the target's window (a ring needs the rejected-draft
rollback rules of docs/echo.md section 4). Bytes per token: `echo_bytes_per_token`.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..configuration import LAYER_HCA
from ..mem_cache.pool import HCA_FP8_TILE, MLA_FP8_TILE, RowCodec, is_fp8


def echo_row_spec(config) -> tuple[str, int, int, int, bool]:
    """(kind, dim, rope, fp8 tile, ue8m0) of the draft's per-token row for the last layer's kind."""
    kind = config.layer_types[-1]
    if kind == LAYER_HCA:
        return kind, config.head_dim, config.qk_rope_head_dim, HCA_FP8_TILE, True
    return kind, config.kv_lora_rank + config.qk_rope_head_dim, config.qk_rope_head_dim, MLA_FP8_TILE, False


def echo_bytes_per_token(config, kv_dtype: torch.dtype) -> int:
    """Draft KV bytes per full-pool token (what the target's pool configurator must reserve for ECHO)."""
    _, dim, rope, tile, _ = echo_row_spec(config)
    if not is_fp8(kv_dtype):
        return 2 * dim
    nope = dim - rope
    tile = min(tile, nope)
    return nope + 4 * (nope // tile) + 2 * rope


class EchoDraftKVPool(KVCache):
    """One layer of per-token rows, addressed by the target's full-pool slots; `layer_id` is the target's
    last layer (the draft runs that very module, whose RadixAttention carries that id)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, config, device: str,
                 enable_memory_saver: bool = False) -> None:  # fmt: skip
        self.layer_id = config.num_hidden_layers - 1
        super().__init__(size, page_size, dtype, 1, device, enable_memory_saver, self.layer_id, self.layer_id)
        self.config = config
        self.kind, dim, rope, tile, ue8m0 = echo_row_spec(config)
        self.window = config.window_size
        sd = (
            torch.float32 if dtype == torch.float32 else torch.bfloat16
        )  # fp32 rows: CPU exactness tests only
        self.token_rows = size + page_size
        self.rows = RowCodec(self.token_rows, dim, rope, is_fp8(dtype), tile, ue8m0, device, sd)
        self._finalize_allocation_log(size)

    def check_layer(self, layer_id: int) -> RowCodec:
        if layer_id != self.layer_id:
            raise ValueError(
                f"the ECHO draft pool holds layer {self.layer_id} (the target's last), not {layer_id}"
            )
        return self.rows

    # ------------------------------------------------------------------ SGLang KVCache surface
    def get_kv_size_bytes(self) -> int:
        return self.rows.nbytes()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"EchoDraftKVPool: {what} is not supported (the ECHO draft backend reads and writes the pool "
            "through its own rows; HiCache/PD/generic KV access are a later stage)"
        )

    def get_key_buffer(self, layer_id: int):
        self._unsupported("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._unsupported("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._unsupported("get_kv_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        self._unsupported("set_kv_buffer")
