"""RoPE for ERNIE-5.5: one YaRN table (DeepSeek-V3 reference form) shared by every layer.

Two pairings (ARCHITECTURE.md convention 1):
- interleaved: dims (2i, 2i+1) rotate together by angle pos * inv_freq[i] (HCA q / kv / compressed
  entries / inverse rotation of the output, MLA q_pe / k_pe);
- rotate-half: dims (i, i + d/2) rotate together (the lightning indexer, as in DeepSeek-V3.2).
"""

from __future__ import annotations

import math

import torch


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
        rope_scaling["beta_fast"], rope_scaling["beta_slow"], rope_dim, base,
        rope_scaling["original_max_position_embeddings"],
    )  # fmt: skip
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


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., rope_dim/2] fp32 for integer positions of any shape."""
    ang = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return ang.cos().float(), ang.sin().float()


def apply_rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1). x [..., T, (heads,) d]; positions [T]. `inverse` rotates by -angle."""
    cos, sin = cos_sin(positions, inv_freq)
    while cos.dim() < x.dim():  # broadcast over head dims between T and d
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_half(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2). x [..., T, (heads,) d]; positions [T]."""
    cos, sin = cos_sin(positions, inv_freq)
    while cos.dim() < x.dim():
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.float()
    half = xf.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).to(x.dtype)
