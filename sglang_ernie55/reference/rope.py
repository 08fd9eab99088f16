"""RoPE for ERNIE-5.5: one YaRN table (DeepSeek-V3 reference form) shared by every layer, two pairings:
interleaved (dims (2i, 2i+1): HCA q / kv / compressed entries / the output's inverse, MLA q_pe / k_pe) and
rotate-half (dims (i, i + d/2): the lightning indexer, as in DeepSeek-V3.2), by angle pos * inv_freq[i].
The inverse frequencies and the MLA softmax scale live in `sglang_ernie55.layers.rope`.
"""

from __future__ import annotations

import torch

from ..layers.rope import mla_softmax_scale, yarn_inv_freq

__all__ = ["apply_rope_half", "apply_rope_interleaved", "cos_sin", "mla_softmax_scale", "yarn_inv_freq"]


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
