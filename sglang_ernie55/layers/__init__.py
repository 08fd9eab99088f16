"""Building blocks of the ERNIE-5.5 SGLang model (attention, latent MoE, mHC, linear policy), and the one
patch they need (its row in patches.py): `around_moe_check` on SGLang's FP8 MoE width check, which
refuses an FP8 block-quantized MoE whose expert width is not a multiple of 128. ERNIE-5.5 builds such
experts unquantized and dequantizes them on load (`layers/moe.py`), so the check is skipped for
ERNIE-5.5 exactly in that case and runs unchanged otherwise.
"""

from __future__ import annotations

from ..arch import is_ernie55


def around_moe_check(original, *args, model_config, **kwargs):
    """AROUND `check_quantized_moe_compatibility`: nothing block-quantized to check for ERNIE-5.5 experts
    of a width the FP8 blocks do not tile (they are dequantized to BF16 on load)."""
    from .linear import FP8_BLOCK

    cfg = model_config.hf_config
    if is_ernie55(cfg) and (cfg.moe_intermediate_size % FP8_BLOCK or cfg.moe_latent_size % FP8_BLOCK):
        return None
    return original(*args, model_config=model_config, **kwargs)
