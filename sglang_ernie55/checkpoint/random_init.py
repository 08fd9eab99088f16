"""Random weights straight from the spec, one tensor at a time (no model in memory): for checkpoints too large
to build through the reference model (the full-width preset). Each tensor's values depend only on (seed,
name), so tensors can be made in any order and streamed to disk; the distributions are those of the
reference model's `init_random_`, so activations stay O(1) through every layer (tested).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from ..configuration import Ernie55Config
from .spec import TensorSpec, expected_tensors


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def random_tensor(
    config: Ernie55Config, name: str, spec: TensorSpec, seed: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """The fp32 value of tensor `name` for `seed`, made on `device` (CPU and CUDA generators give different,
    equally good draws): Linear weights N(0, 1/fan_in); the embedding N(0, 1); norm weights 1 + N(0, 0.1^2);
    biases N(0, 0.05^2); mHC fn N(0, 0.25/(n*H)), base N(0, 0.1^2), scale 1 + N(0, 0.1^2); attn_sink and
    ape N(0, 0.5^2)."""
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    shape = spec.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32, device=device) * std

    leaf = name.rsplit(".", 1)[-1]
    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if len(shape) == 2 and leaf == "weight":  # Linear
        return normal(shape[1] ** -0.5)
    if leaf == "bias" or leaf == "e_score_correction_bias":
        return normal(0.05)
    if leaf == "weight":  # 1-D norm weights
        return 1.0 + normal(0.1)
    if leaf == "fn":
        return normal(0.5 * shape[1] ** -0.5)
    if leaf == "base":
        return normal(0.1)
    if leaf == "scale":
        return 1.0 + normal(0.1)
    if leaf in ("attn_sink", "ape"):
        return normal(0.5)
    raise KeyError(f"random init: no rule for tensor {name}")


def iter_random_tensors(
    config: Ernie55Config, seed: int, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor on `device`) for every tensor of the spec, in spec order."""
    for name, spec in expected_tensors(config).items():
        yield name, random_tensor(config, name, spec, seed, device)
