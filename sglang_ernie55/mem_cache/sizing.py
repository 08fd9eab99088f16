"""KV-pool sizing arithmetic of ERNIE-5.5 (docs/serving-design.md section 4), and the configurator
SGLang's `KVCacheConfigurator` uses for our architecture.

Bytes per full-pool token:
    n_hca * (swa_ratio * window_row + cmp_row / compress_ratio) + n_mla * (latent_row + index_row)
Fixed bytes: the open-block state, `req_slots * n_hca * compress_ratio * 2 * head_dim * 4`.
Stage 1 keeps the HCA window for every token (`swa_ratio = 1`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..configuration import LAYER_HCA

FP8_KV = "fp8_e4m3"
BF16_KV = "bfloat16"
KV_DTYPES = (FP8_KV, BF16_KV)


def normalize_kv_dtype(name: str) -> str:
    """SGLang's `--kv-cache-dtype` value (or torch dtype name) -> fp8_e4m3 | bfloat16."""
    n = str(name).replace("torch.", "")
    if n in ("fp8_e4m3", "float8_e4m3fn", "uint8"):
        return FP8_KV
    if n in ("bfloat16", "bf16"):
        return BF16_KV
    raise ValueError(f"ERNIE-5.5 KV cache dtype must be fp8_e4m3 or bfloat16, got {name!r}")


@dataclass(frozen=True)
class KVBytes:
    """Bytes per full-pool token of each buffer (page bytes / tokens per page, page padding included)."""

    window_row: float
    cmp_row: float  # per compressed entry
    latent_row: float
    index_row: float
    state_per_slot: int  # all HCA layers
    n_hca: int
    n_mla: int
    ratio: int

    def per_full_token(self, swa_ratio: float = 1.0) -> float:
        return (self.n_hca * (swa_ratio * self.window_row + self.cmp_row / self.ratio)
                + self.n_mla * (self.latent_row + self.index_row))  # fmt: skip


def kv_bytes(config, kv_dtype: str, page_size: int = 256) -> KVBytes:
    """From the byte layouts of `sglang_ernie55.kernels.layout` at this config's widths."""
    from ..kernels.layout import hca_geometry, idx_geometry, mla_geometry

    c = config
    kv = normalize_kv_dtype(kv_dtype)
    n_hca = sum(t == LAYER_HCA for t in c.layer_types)
    n_mla = len(c.layer_types) - n_hca
    D, r = c.head_dim, c.qk_rope_head_dim
    per = lambda g: g.page_bytes / g.page_size  # noqa: E731
    return KVBytes(
        window_row=per(hca_geometry(kv, D, r, page_size)),
        cmp_row=per(hca_geometry(kv, D, r, page_size // c.compress_ratio)),
        latent_row=per(mla_geometry(kv, c.kv_lora_rank, r, page_size)),
        index_row=per(idx_geometry(kv, c.index_head_dim, page_size)),
        state_per_slot=n_hca * c.compress_ratio * 2 * D * 4,
        n_hca=n_hca, n_mla=n_mla, ratio=c.compress_ratio,
    )  # fmt: skip


def pool_tokens(
    available_bytes: int, b: KVBytes, page_size: int, req_slots: int, swa_ratio: float = 1.0
) -> int:
    """Full-pool tokens (page aligned) that fit `available_bytes` after the fixed state of `req_slots`."""
    rest = available_bytes - (req_slots + 1) * b.state_per_slot
    tokens = int(max(rest, 0) // b.per_full_token(swa_ratio))
    return tokens // page_size * page_size


def _make_configurator():
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator
    from sglang.srt.runtime_context import get_schedule

    class Ernie55PoolConfigurator(MemoryPoolConfigurator):
        """Sizes `Ernie55TokenToKVPool` (one token count; stage 1 keeps the window per token)."""

        DEFAULT_REQ_SLOTS = 4096  # SGLang's resolve_max_num_reqs never exceeds this without a user cap

        def __init__(self, kvc):
            self.bytes = kv_bytes(
                kvc.model_config.hf_config, kvc.kv_cache_dtype_str or str(kvc.kv_cache_dtype)
            )
            cap = get_schedule().max_running_requests
            self.req_slots = int(cap) if cap else self.DEFAULT_REQ_SLOTS

        def calculate_pool_sizes(self, available_bytes, page_size):
            return MemoryPoolConfig(max_total_num_tokens=pool_tokens(available_bytes, self.bytes, page_size,
                                                                     self.req_slots))  # fmt: skip

        def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens, page_size):
            return MemoryPoolConfig(max_total_num_tokens=max_total_num_tokens // page_size * page_size)

    return Ernie55PoolConfigurator
