"""KV-pool sizing arithmetic of ERNIE-5.5 (docs/serving-design.md section 4), and the configurator
SGLang's `KVCacheConfigurator` uses for our architecture.

Two token pools, as SGLang's hybrid-SWA configurators size them (DSV4PoolConfigurator's ratio mode):
the full pool (`full_tokens`: MLA-DSA latents + indexer keys, compressed HCA entries) and the SWA pool
(`swa_tokens = floor(full_tokens * swa_full_tokens_ratio)` to whole pages: the HCA window rows, and the
ECHO draft's window rows when speculating). Bytes per full-pool token:

    n_hca * (swa_ratio * window_row + cmp_row / compress_ratio) + n_mla * (latent_row + index_row)
      + swa_ratio * draft_row

(rows = page bytes / tokens per page of the kernels/layout.py geometries, page padding included). Fixed
bytes: the open-block state, `(req_slots + 1) * n_hca * state_blocks * compress_ratio * 2 * head_dim * 4`
(state_blocks 2 under speculative decoding: kernels/layout.py, docs/echo.md section 5.4). Without an SWA
pool (`--disable-hybrid-swa-memory`) the window rows sit at every full slot: swa_ratio = 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..configuration import LAYER_HCA

logger = logging.getLogger(__name__)

FP8_KV = "fp8_e4m3"
BF16_KV = "bfloat16"
KV_DTYPES = (FP8_KV, BF16_KV)
SIZING_LOG = "ERNIE-5.5 pool sizing:"


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
    """Bytes per token of each buffer (page bytes / tokens per page, page padding included)."""

    window_row: float  # per SWA token, per HCA layer
    cmp_row: float  # per compressed entry, per HCA layer
    latent_row: float  # per full token, per MLA-DSA layer
    index_row: float
    state_per_slot: int  # all HCA layers
    n_hca: int
    n_mla: int
    ratio: int
    draft_row: float = 0.0  # per SWA token: the ECHO draft's one window layer (0 without speculation)

    def per_swa_token(self) -> float:
        return self.n_hca * self.window_row + self.draft_row

    def per_full_token(self, swa_ratio: float = 1.0) -> float:
        return (swa_ratio * self.per_swa_token() + self.n_hca * self.cmp_row / self.ratio
                + self.n_mla * (self.latent_row + self.index_row))  # fmt: skip

    def allocated(self, full_tokens: int, swa_tokens: int | None, req_slots: int, page_size: int = 256) -> int:
        """Exact bytes `Ernie55TokenToKVPool(full_tokens, swa_size=swa_tokens, num_req_slots=req_slots)` (and
        the ECHO draft pool when `draft_row`) allocate in a packed (fp8 / bf16) layout: every token buffer
        has one padding page; the compressed buffer one scratch entry, rounded to whole compressed pages."""
        rows = full_tokens + page_size
        win_rows = (full_tokens if swa_tokens is None else swa_tokens) + page_size
        cmp_page = page_size // self.ratio
        cmp_rows = -(-(rows // self.ratio + 1) // cmp_page) * cmp_page
        total = (win_rows * self.per_swa_token() + self.n_hca * cmp_rows * self.cmp_row
                 + self.n_mla * rows * (self.latent_row + self.index_row)
                 + (req_slots + 1) * self.state_per_slot)  # fmt: skip
        return round(total)


def state_blocks_for(spec_algorithm) -> int:
    """Blocks of the HCA open-block state ring: 2 when the server verifies speculative drafts (any SGLang
    `SpeculativeAlgorithm` other than NONE), else 1."""
    from ..kernels.layout import HCA_STATE_BLOCKS, HCA_STATE_BLOCKS_SPEC

    speculative = spec_algorithm is not None and not spec_algorithm.is_none()
    return HCA_STATE_BLOCKS_SPEC if speculative else HCA_STATE_BLOCKS


def kv_bytes(config, kv_dtype: str, page_size: int = 256, echo: bool = False, state_blocks: int = 1) -> KVBytes:
    """From the byte layouts of `sglang_ernie55.kernels.layout` at this config's widths; `echo` adds the ECHO
    draft's window row (the target's last layer: its window layout if HCA, its latent layout if MLA-DSA,
    = `speculative.pool.echo_bytes_per_token`); `state_blocks` is the open-block state ring (`state_blocks_for`)."""
    from ..kernels.layout import hca_geometry, idx_geometry, mla_geometry

    c = config
    kv = normalize_kv_dtype(kv_dtype)
    n_hca = sum(t == LAYER_HCA for t in c.layer_types)
    n_mla = len(c.layer_types) - n_hca
    D, r = c.head_dim, c.qk_rope_head_dim
    per = lambda g: g.page_bytes / g.page_size  # noqa: E731
    window_row = per(hca_geometry(kv, D, r, page_size))
    latent_row = per(mla_geometry(kv, c.kv_lora_rank, r, page_size))
    draft_row = (window_row if c.layer_types[-1] == LAYER_HCA else latent_row) if echo else 0.0
    return KVBytes(
        window_row=window_row,
        cmp_row=per(hca_geometry(kv, D, r, page_size // c.compress_ratio)),
        latent_row=latent_row,
        index_row=per(idx_geometry(kv, c.index_head_dim, page_size)),
        state_per_slot=n_hca * state_blocks * c.compress_ratio * 2 * D * 4,
        n_hca=n_hca, n_mla=n_mla, ratio=c.compress_ratio, draft_row=draft_row,
    )  # fmt: skip


def pool_tokens(
    available_bytes: int, b: KVBytes, page_size: int, req_slots: int, swa_ratio: float = 1.0
) -> int:
    """Full-pool tokens (page aligned) that fit `available_bytes` after the fixed state of `req_slots`."""
    rest = available_bytes - (req_slots + 1) * b.state_per_slot
    tokens = int(max(rest, 0) // b.per_full_token(swa_ratio))
    return tokens // page_size * page_size


def swa_tokens_for(full_tokens: int, swa_ratio: float, page_size: int) -> int:
    """SGLang's rule (HybridSWAPoolConfigurator / DSV4PoolConfigurator ratio mode): whole pages of the ratio."""
    return int(full_tokens * swa_ratio) // page_size * page_size


def _make_configurator():
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator
    from sglang.srt.runtime_context import get_schedule

    class Ernie55PoolConfigurator(MemoryPoolConfigurator):
        """Sizes `Ernie55TokenToKVPool`: full + SWA token counts in hybrid mode (SGLang's
        `SWATokenToKVPoolAllocator` and SWA radix cache), one token count without an SWA pool."""

        DEFAULT_REQ_SLOTS = 4096  # SGLang's resolve_max_num_reqs never exceeds this without a user cap

        def __init__(self, kvc):
            spec = getattr(kvc, "spec_algorithm", None)
            speculating = spec is not None and not spec.is_none() and not kvc.is_draft_worker
            self.bytes = kv_bytes(kvc.model_config.hf_config, kvc.kv_cache_dtype_str or str(kvc.kv_cache_dtype),
                                  echo=speculating, state_blocks=state_blocks_for(spec))  # fmt: skip
            self.hybrid = bool(kvc.is_hybrid_swa)
            self.swa_ratio = float(get_schedule().swa_full_tokens_ratio) if self.hybrid else 1.0
            self.sliding_window_size = kvc.sliding_window_size
            cap = get_schedule().max_running_requests
            self.req_slots = int(cap) if cap else self.DEFAULT_REQ_SLOTS

        def _config(self, full_tokens: int, page_size: int, source: str):
            full = full_tokens // page_size * page_size
            per_full = self.bytes.per_full_token(self.swa_ratio)
            if not self.hybrid:
                logger.info(f"{SIZING_LOG} mode=full-only ({source}) full_tokens={full} swa_tokens=None "
                            f"bytes_per_full_token={per_full:.1f}")  # fmt: skip
                return MemoryPoolConfig(max_total_num_tokens=full)
            swa = swa_tokens_for(full, self.swa_ratio, page_size)
            self.validate_swa_pool_size(swa, self.sliding_window_size, page_size)
            logger.info(
                f"{SIZING_LOG} mode=hybrid-swa ({source}) full_tokens={full} swa_tokens={swa} "
                f"swa_full_tokens_ratio={self.swa_ratio} bytes_per_full_token={per_full:.1f} "
                f"bytes_per_swa_token={self.bytes.per_swa_token():.1f} req_slots={self.req_slots}"
            )
            return MemoryPoolConfig(max_total_num_tokens=full, full_max_total_num_tokens=full,
                                    swa_max_total_num_tokens=swa)  # fmt: skip

        def calculate_pool_sizes(self, available_bytes, page_size):
            full = pool_tokens(available_bytes, self.bytes, page_size, self.req_slots, self.swa_ratio)
            return self._config(full, page_size, "memory budget")

        def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens, page_size):
            return self._config(max_total_num_tokens, page_size, "token cap")

    return Ernie55PoolConfigurator
