"""Per-layer FP8 policy of the model's Linears: which ones keep SGLang's FP8 block method. That method needs
the activation width, and once sharded or merged the output width, to be multiples of 128; every Linear of
the full-size model qualifies. A Linear that does not is built unquantized and the loader dequantizes its
FP8 tensors (`checkpoint.fp8.Fp8Pairs`), so both paths compute the same W. `InputProjections` serves the
Linears of a layer that read the same input as one GEMM per FP8 decision.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.spec import FP8_BLOCK


def fp8_block_ok(in_features: int, out_features: int) -> bool:
    """Whether SGLang's FP8 block-quant Linear can serve this shape (see module docstring)."""
    return in_features % FP8_BLOCK == 0 and out_features % FP8_BLOCK == 0


def linear_quant_config(quant_config, in_features: int, out_features: int):
    """`quant_config` when the FP8 block method can serve the shape, else None (dequantize on load)."""
    if quant_config is None or not fp8_block_ok(in_features, out_features):
        return None
    return quant_config


class InputProjections(nn.Module):
    """The Linears of one layer that read the same input, served as one GEMM per FP8 decision (SGLang's
    `MergedColumnParallelLinear` over the replicated group, as DeepSeek's fused q_a / kv_a projection): one
    activation quantisation and one GEMM launch where there were one per Linear. Merging changes no value:
    FP8 activations are quantised per token over groups of 128 input columns, the same for every part, and
    each output column is the same dot product. Parts keep their checkpoint names (`parts`, relative to
    `prefix`); a part goes with the FP8 group when `linear_quant_config` admits its shape and it is not in
    `never_fp8` (Linears the checkpoint keeps in BF16), else with the unquantized one.

    `forward(x)` returns the parts' outputs, in the order of `parts`, as column views of the merged
    outputs (rows strided by the merged width)."""

    def __init__(
        self,
        in_features: int,
        parts: dict[str, int],
        quant_config,
        prefix: str,
        never_fp8: tuple[str, ...] = (),
    ):
        super().__init__()
        from sglang.srt.layers.linear import MergedColumnParallelLinear

        groups: dict[bool, list[str]] = {}
        for name, width in parts.items():
            fp8 = name not in never_fp8 and linear_quant_config(quant_config, in_features, width) is not None
            groups.setdefault(fp8, []).append(name)
        self.linears = nn.ModuleList()
        where: dict[str, tuple[int, int, int]] = {}
        for fp8, names in groups.items():
            i, off = len(self.linears), 0
            lin = MergedColumnParallelLinear(
                in_features,
                [parts[n] for n in names],
                bias=False,
                quant_config=quant_config if fp8 else None,
                prefix=f"{prefix}.x_proj.linears.{i}" if prefix else f"x_proj.linears.{i}",
                parallel_group="replicated",
            )
            # checkpoint module names of the parts, in shard order: the model's loader maps them to this Linear
            lin.ernie_parts = tuple(f"{prefix}.{n}" if prefix else n for n in names)
            self.linears.append(lin)
            for n in names:
                where[n] = (i, off, parts[n])
                off += parts[n]
        self._where = [where[n] for n in parts]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [lin(x)[0] for lin in self.linears]
        return [outs[i][:, off : off + w] for i, off, w in self._where]
