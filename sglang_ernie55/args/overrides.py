"""The model's defaults, declared through SGLang's model-override registry.

SGLang runs the providers inside `handle_model_specific_adjustments`, after the platform defaults (so on
`--device cpu` our `ernie55` replaces `torch_native`) and before `_page_size_default`. They declare and
never mutate server_args; user-given values that break a rule were already refused by `resolution.py`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..configuration import SERVING_PAGE_SIZE
from . import rules

logger = logging.getLogger(__name__)


def ernie55_overrides(server_args: Any, hf_config: Any) -> dict:
    """attention backend `ernie55`, page size 256, swa ratio 0.1 when unset, KV dtype mapped (the default
    fp8_e4m3, or bfloat16 where the checkpoint's widths do not fit the fp8 layouts)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    out: dict[str, Any] = {"attention_backend": rules.ATTENTION_BACKEND, "page_size": SERVING_PAGE_SIZE}
    # A platform default may have pinned the split backends (NPU pins all three); keep them consistent.
    for field in ("prefill_attention_backend", "decode_attention_backend"):
        if getattr(cfg, field) is not None:
            out[field] = rules.ATTENTION_BACKEND
    if cfg.swa_full_tokens_ratio is None:
        out["swa_full_tokens_ratio"] = rules.SWA_FULL_TOKENS_RATIO
    for field, flag in (
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("speculative_draft_kv_cache_dtype", "--speculative-draft-kv-cache-dtype"),
    ):
        value = getattr(cfg, field)
        if field == "speculative_draft_kv_cache_dtype" and value is None:
            continue  # the draft follows --kv-cache-dtype
        # the checkpoint's widths decide whether the default fp8_e4m3 layouts can hold its cache
        dtype, note = rules.resolve_kv_cache_dtype(value, flag, hf_config)
        if note:
            logger.info("ERNIE-5.5: %s", note)
        if dtype != value:
            out[field] = dtype
    return out
