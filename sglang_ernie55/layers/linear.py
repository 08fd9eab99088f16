"""Per-layer FP8 policy of the model's Linears: which ones keep SGLang's FP8 block method.

SGLang's FP8 block method (128x128, Triton `w8a8_block_fp8_matmul` where DeepGEMM is absent) needs
the activation width to be a multiple of 128 (per-token-group activation quantisation) and, once
sharded or merged, the output width too. Every Linear of the full-size model qualifies; the tiny
test geometry has ragged widths on purpose. A Linear that does not qualify is built unquantized
and the model's loader dequantizes its FP8 tensors (`checkpoint.fp8.Fp8Pairs`, ARCHITECTURE.md
convention 12), so both paths compute the same W.
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
