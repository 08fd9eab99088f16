"""Every environment variable this package reads, in one place (the table: docs/server-args.md,
"Environment variables")."""

from __future__ import annotations

import functools
import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _default_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def skip_version_check() -> bool:
    """`SGLANG_ERNIE55_SKIP_VERSION_CHECK=1`: load on an SGLang other than the pinned one (unsupported)."""
    return _flag("SGLANG_ERNIE55_SKIP_VERSION_CHECK")


def profile_ranges() -> bool:
    """`SGLANG_ERNIE55_PROFILE_RANGES=1`: the forward opens named profiler ranges (sglang_ernie55.profiling)."""
    return _flag("SGLANG_ERNIE55_PROFILE_RANGES")


def allow_parsers() -> bool:
    """`SGLANG_ERNIE55_ALLOW_PARSERS=1`: let `--reasoning-parser` / `--tool-call-parser` through on the Base model."""
    return _flag("SGLANG_ERNIE55_ALLOW_PARSERS")


def fused_decode_meta() -> bool:
    """`SGLANG_ERNIE55_FUSED_META` (default 1): the kernel path builds a decode / verify batch's index rows in one
    Triton launch (kernels/decode_meta.py); 0: in torch ops (`KernelPath.fixed_meta`)."""
    return _default_on("SGLANG_ERNIE55_FUSED_META")


def fused_topk() -> bool:
    """`SGLANG_ERNIE55_FUSED_TOPK` (default 1): the kernel path selects the indexer's top-k as cache slots in one
    Triton launch (kernels/indexer.py `indexer_topk`); 0: in torch ops (`indexer_topk_torch`)."""
    return _default_on("SGLANG_ERNIE55_FUSED_TOPK")


def mla_sparse_prefill() -> bool:
    """`SGLANG_ERNIE55_MLA_SPARSE_PREFILL` (default 1): where FlashMLA serves the MLA-DSA layers, extend
    batches attend through its sparse prefill kernel over a bf16 copy of the batch's latent rows; 0: its
    decode kernel, as decode batches."""
    return _default_on("SGLANG_ERNIE55_MLA_SPARSE_PREFILL")


def hca_sparse_prefill() -> bool:
    """`SGLANG_ERNIE55_HCA_SPARSE_PREFILL=1` (default 0): where FlashMLA serves the HCA layers, extend batches
    attend through its sparse prefill kernel over a bf16 copy of the batch's window and compressed rows (one
    index row per query over both); 0: its decode kernel with the two scopes, as decode batches."""
    return _flag("SGLANG_ERNIE55_HCA_SPARSE_PREFILL")


# rows 8: wrong logits on the H100 at 64 keys per step (`indexer.ROWS_HEADS_MAX`); 32 keys x 8 rows is
# right but untimed, so serving takes 1 / 2 / 4
INDEXER_EXTEND_KEYS, INDEXER_EXTEND_WARPS, INDEXER_EXTEND_ROWS = (32, 64, 128, 256), (4, 8), (1, 2, 4)


def indexer_extend_config() -> tuple[int, int, bool, bool, int] | None:
    """`SGLANG_ERNIE55_INDEXER_EXTEND`: `keys,warps,keys_major,rows` (e.g. `128,4,0,1`), the indexer logits'
    launch config for extend batches (`indexer_logits`' config: keys per step, warps, keys major 0 / 1, query
    rows per program); unset: `LOGITS_EXTEND`. For measuring other configs in a served batch."""
    raw = os.environ.get("SGLANG_ERNIE55_INDEXER_EXTEND", "").strip()
    if not raw:
        return None
    legal = (
        f"keys per step in {INDEXER_EXTEND_KEYS}, warps in {INDEXER_EXTEND_WARPS}, keys major 0 or 1, rows "
        f"in {INDEXER_EXTEND_ROWS}"
    )
    try:
        keys, warps, km, rows = (int(x) for x in raw.split(","))
    except ValueError:
        keys = warps = km = rows = -1
    if (
        keys not in INDEXER_EXTEND_KEYS
        or warps not in INDEXER_EXTEND_WARPS
        or km not in (0, 1)
        or rows not in INDEXER_EXTEND_ROWS
    ):
        raise ValueError(f"SGLANG_ERNIE55_INDEXER_EXTEND={raw!r}: keys,warps,keys_major,rows with {legal}")
    return (keys, warps, True, bool(km), rows)


PREFILL_WARMUP_MODES = ("auto", "1", "0")


def prefill_warmup() -> str:
    """`SGLANG_ERNIE55_PREFILL_WARMUP`: one of PREFILL_WARMUP_MODES. `auto` (default): an ERNIE-5.5 CUDA
    server outside PD disaggregation sends one prompt of four chunks and more, then short ones of each
    power-of-two length bucket, before SGLang's warm-up request, so the first prompt of a new length does not
    wait for Triton's compiles (sglang_ernie55.warmup); `1`: on any device; `0`: never."""
    v = os.environ.get("SGLANG_ERNIE55_PREFILL_WARMUP", "auto").strip().lower() or "auto"
    if v not in PREFILL_WARMUP_MODES:
        raise ValueError(
            f"SGLANG_ERNIE55_PREFILL_WARMUP={v!r}: legal values are {', '.join(PREFILL_WARMUP_MODES)}"
        )
    return v


def sglang_plugins_whitelist() -> set[str] | None:
    """SGLang's own `SGLANG_PLUGINS` whitelist; `ernie55` must be in it when it is set."""
    raw = os.environ.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in raw.split(",") if x.strip()}
    return names or None


ATTN_IMPLS = ("auto", "torch", "triton", "flashmla")


def attn_impl() -> str:
    """`SGLANG_ERNIE55_ATTN_IMPL`: one of ATTN_IMPLS (default `auto`); see sglang_ernie55.attention.select."""
    if "SGLANG_ERNIE55_HCA_ATTN" in os.environ:
        raise ValueError(
            "SGLANG_ERNIE55_HCA_ATTN was replaced by SGLANG_ERNIE55_ATTN_IMPL (auto | torch | triton | flashmla), "
            "which selects the compute of every layer kind; unset SGLANG_ERNIE55_HCA_ATTN"
        )
    v = os.environ.get("SGLANG_ERNIE55_ATTN_IMPL", "auto").strip().lower() or "auto"
    if v not in ATTN_IMPLS:
        raise ValueError(f"SGLANG_ERNIE55_ATTN_IMPL={v!r}: legal values are {', '.join(ATTN_IMPLS)}")
    return v


MHC_MIXES = ("cublas", "fused")


def mhc_mix() -> str:
    """`SGLANG_ERNIE55_MHC_MIX`: one of MHC_MIXES (default `cublas`), how an mHC site on the kernels makes its
    raw mix and RMS factor for batches of `kernels.mhc.FUSED_MIX_MIN_ROWS` tokens and more: `cublas` (an fp32
    GEMM, then the tail reads the streams twice), `fused` (one Triton pass makes both, the tail reads them
    once)."""
    return _choice("SGLANG_ERNIE55_MHC_MIX", os.environ.get("SGLANG_ERNIE55_MHC_MIX", ""), MHC_MIXES)


LAYER_IMPLS = ("auto", "torch", "triton")


def layer_impl() -> str:
    """`SGLANG_ERNIE55_LAYER_IMPL`: one of LAYER_IMPLS (default `auto`); see sglang_ernie55.layers.impl."""
    return _choice("SGLANG_ERNIE55_LAYER_IMPL", os.environ.get("SGLANG_ERNIE55_LAYER_IMPL", ""), LAYER_IMPLS)


@functools.lru_cache(maxsize=32)
def _choice(name: str, raw: str, legal: tuple[str, ...]) -> str:
    """A per-call knob's value, lower-cased (empty: the first legal value, its default); another is refused,
    naming the legal ones. Cached: the hot paths read it per call."""
    v = raw.strip().lower() or legal[0]
    if v not in legal:
        raise ValueError(f"{name}={raw!r}: legal values are {', '.join(legal)}")
    return v
