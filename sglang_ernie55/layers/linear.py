"""Per-layer FP8 policy of the model's Linears: which ones keep SGLang's FP8 block method. That method needs
the activation width, and once sharded or merged the output width, to be multiples of 128; every Linear of
the full-size model qualifies. A Linear that does not is built unquantized and the loader dequantizes its
FP8 tensors (`checkpoint.fp8.Fp8Pairs`), so both paths compute the same W.
"""

from __future__ import annotations

from ..checkpoint.spec import FP8_BLOCK


def fp8_block_ok(in_features: int, out_features: int) -> bool:
    """Whether SGLang's FP8 block-quant Linear can serve this shape (see module docstring)."""
    return in_features % FP8_BLOCK == 0 and out_features % FP8_BLOCK == 0


def linear_quant_config(quant_config, in_features: int, out_features: int):
    """`quant_config` when the FP8 block method can serve the shape, else None (dequantize on load)."""
    if quant_config is None or not fp8_block_ok(in_features, out_features):
        return None
    return quant_config
