"""Building blocks of the ERNIE-5.5 SGLang model (attention, latent MoE, mHC, linear policy).

`register()` adds the one hook these layers need (patch ledger: docs/hooks.md):
AROUND `sglang.srt.model_executor.model_runner_components.moe_ep_setup.check_quantized_moe_compatibility`
— SGLang refuses an FP8 block-quantized MoE whose expert width is not a multiple of 128; ERNIE-5.5
builds such experts unquantized and dequantizes them on load (`layers/moe.py`), so the check is
skipped for ERNIE-5.5 exactly in that case and runs unchanged otherwise.
"""

from __future__ import annotations

HOOK_MOE_CHECK = (
    "sglang.srt.model_executor.model_runner_components.moe_ep_setup.check_quantized_moe_compatibility"
)

_registered = False


def _around_moe_check(original, *args, model_config, **kwargs):
    from ..configuration import ARCHITECTURES
    from .linear import FP8_BLOCK

    cfg = model_config.hf_config
    if any(a in ARCHITECTURES for a in (getattr(cfg, "architectures", None) or [])):
        if cfg.moe_intermediate_size % FP8_BLOCK or cfg.moe_latent_size % FP8_BLOCK:
            return None  # experts are dequantized to BF16 on load: nothing block-quantized to check
    return original(*args, model_config=model_config, **kwargs)


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_MOE_CHECK, _around_moe_check, HookType.AROUND)
    _registered = True
