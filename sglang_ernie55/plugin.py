"""The SGLang plugin: entry point `sglang.srt.plugins` -> `ernie55` -> `register()`.

SGLang calls `register()` in every process it starts (launcher, scheduler, detokenizer, DP
controller) before it parses arguments. It is idempotent. What it registers:

1. `Ernie55Config` for model_type `ernie5_5_moe` (transformers AutoConfig + SGLang's config registry);
2. the architectures `Ernie5_5_MoeForCausalLM` / `Ernie5_5MoeMTPModel` in SGLang's ModelRegistry
   (modules of `sglang_ernie55.models`, imported strictly: an import error is raised, not logged);
3. server-argument defaults and validation for these architectures (`sglang_ernie55.args`);
4. the `ernie55` attention backend and the hooks of the patch ledger (docs/hooks.md).
"""

from __future__ import annotations

import logging

from . import compat

logger = logging.getLogger(__name__)

_registered = False


def register_config() -> None:
    from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
    from transformers import AutoConfig

    from .configuration import MODEL_TYPE, Ernie55Config

    AutoConfig.register(MODEL_TYPE, Ernie55Config, exist_ok=True)
    _CONFIG_REGISTRY[MODEL_TYPE] = Ernie55Config


def register_models() -> None:
    from sglang.srt.models.registry import ModelRegistry

    from .configuration import ARCHITECTURES

    owned = {a: ModelRegistry.models.get(a) for a in ARCHITECTURES}
    if all(c is not None and c.__module__.startswith("sglang_ernie55.") for c in owned.values()):
        return
    ModelRegistry.register("sglang_ernie55.models", overwrite=False, strict=True)


def register() -> None:
    """Entry point called by SGLang's plugin loader; safe to call any number of times."""
    global _registered
    if _registered:
        return
    compat.check()
    register_config()
    from . import args, attention, layers, mem_cache, speculative

    args.register()  # defaults + validation of the server arguments
    attention.register()  # the `ernie55` attention backend factory
    layers.register()  # MoE width check hook (dequantised tiny experts)
    mem_cache.register()  # pool configurator / pool builder hooks
    speculative.register()  # ECHO draft wiring (after mem_cache: nests around its pool hook)
    register_models()
    _registered = True
    logger.info("sglang-ernie55 plugin registered")
