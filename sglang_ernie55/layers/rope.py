"""RoPE of the serving model: the YaRN inverse frequencies and the MLA softmax scale (model facts: this is their
one home, the reference model imports them from here), the torch rotations (interleaved pairs (2i, 2i+1) on the
last dims: HCA q / kv / compressed entries / the output's inverse rotation, MLA q_pe / k_pe; rotate-half pairs
(i, i + d/2) on the first dims: the lightning indexer), and `RopeTable`, the one table every layer shares, which
rotates on the Triton kernel or in torch (`layers.impl`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .impl import use_kernels

# ----------------------------------------------------------------------------- model facts


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_pos: int
) -> tuple[int, int]:
    low = math.floor(_correction_dim(beta_fast, dim, base, max_pos))
    high = math.ceil(_correction_dim(beta_slow, dim, base, max_pos))
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001
    return ((torch.arange(n, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def yarn_inv_freq(rope_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """inv_freq [rope_dim/2] (fp32): DeepSeek-V3 `precompute_freqs_cis`, YaRN always applied when given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if rope_scaling is None:
        return inv_freq
    factor = float(rope_scaling["factor"])
    low, high = _correction_range(
        rope_scaling["beta_fast"],
        rope_scaling["beta_slow"],
        rope_dim,
        base,
        rope_scaling["original_max_position_embeddings"],
    )
    smooth = 1 - _linear_ramp(low, high, rope_dim // 2)
    return inv_freq / factor * (1 - smooth) + inv_freq * smooth


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """(nope + rope)^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 only if the config gives it."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        m = yarn_get_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


# ----------------------------------------------------------------------------- torch rotations


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., rope_dim/2] fp32 for integer positions of any shape (float64 angles)."""
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return ang.cos().float(), ang.sin().float()


def _broadcast(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    while cos.dim() < x.dim():  # over the head dims between T and d
        cos, sin = cos[..., None, :], sin[..., None, :]
    return cos, sin


def rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [T, (heads,) d] by positions [T]; `inverse` rotates by -angle."""
    cos, sin = _broadcast(*cos_sin(positions, inv_freq), x)
    if inverse:
        sin = -sin
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


def rope_half(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [T, (heads,) d] by positions [T]."""
    cos, sin = _broadcast(*cos_sin(positions, inv_freq), x)
    xf = x.float()
    half = xf.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- the model's table


@dataclasses.dataclass
class RopePositions:
    """One forward's positions [T], with the cos / sin rows [T, rope / 2] (fp32) of those positions when the
    kernels rotate (computed once per forward, shared by every layer; fixed shapes, graph-safe)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RopeTable(nn.Module):
    """One YaRN inverse-frequency table shared by every layer."""

    def __init__(self, config):
        super().__init__()
        inv = yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_dim = config.qk_rope_head_dim

    def at(self, positions) -> RopePositions:
        """The forward's `RopePositions` (a `RopePositions` passes through). On the kernels the cos / sin rows
        are `cos_sin(positions, inv_freq)`, the torch rotations' own values, computed here once."""
        if isinstance(positions, RopePositions):
            return positions
        if use_kernels(positions):
            c, s = cos_sin(positions, self.inv_freq)
            return RopePositions(positions, c.contiguous(), s.contiguous())
        return RopePositions(positions)

    def interleaved(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return rope_interleaved(x, pos, self.inv_freq, inverse=inverse)

    def half(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope_half(x, pos, self.inv_freq)

    def tail_(self, x: torch.Tensor, rp: RopePositions, inverse: bool = False) -> torch.Tensor:
        """Interleaved RoPE on the last rope_dim dims of x [T, h, D] or [T, D]. Kernels: in place on x (which
        must be a tensor the caller owns, last dim contiguous), returns x; torch: returns a new tensor."""
        if rp.cos is not None and x.stride(-1) == 1:
            from ..kernels.rope import rope_

            rope_(x if x.dim() == 3 else x.unsqueeze(1), None, rp.cos, rp.sin, inverse)
            return x
        r = self.rope_dim
        return torch.cat([x[..., :-r], self.interleaved(x[..., -r:], rp.positions, inverse)], dim=-1)

    def rotated_tail(self, x: torch.Tensor, rp: RopePositions) -> torch.Tensor:
        """The last rope_dim dims of x, rotated (interleaved). Kernels: rotated in place inside x (a tensor the
        caller owns) and returned as a view of it; torch: a new tensor (x untouched)."""
        r = self.rope_dim
        if rp.cos is not None and x.stride(-1) == 1:
            return self.tail_(x, rp)[..., -r:]
        return self.interleaved(x[..., -r:], rp.positions)

    def head_half_(self, x: torch.Tensor, rp: RopePositions) -> torch.Tensor:
        """Rotate-half RoPE on the first rope_dim dims of x [T, h, D] or [T, D] (the indexer); in place on the
        kernels, like `tail_`."""
        if rp.cos is not None and x.stride(-1) == 1:
            from ..kernels.rope import rope_

            rope_(x if x.dim() == 3 else x.unsqueeze(1), None, rp.cos, rp.sin, neox=True, start=0)
            return x
        r = self.rope_dim
        return torch.cat([self.half(x[..., :r], rp.positions), x[..., r:]], dim=-1)
