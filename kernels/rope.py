"""Interleaved RoPE on the last ``rope_dim`` dims of [T, h, D], in place: the HCA output's inverse
rotation (right after sparse_mqa_attention), or the forward rotation.

Formula (rope.apply_rope_interleaved): pairs (2i, 2i+1) of x[t, :, D - rope:] rotate by
sign * positions[t] * inv_freq[i]; cos/sin come from tables (rope.cos_sin(arange(max_pos), inv_freq)).
"""

from __future__ import annotations

import torch

from ._pool import check
from ._triton.rope import rope_inplace_kernel


def rope_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """x: [T, h, D] bf16/fp16/fp32, last dim contiguous (modified in place and returned);
    positions: int32/int64 [T]; cos, sin: fp32 [max_pos, rope/2] with the same row stride, last dim
    contiguous; rope = 2 * cos.shape[1] (a power of two) <= D. ``inverse`` rotates by -angle."""
    check(x.dim() == 3 and x.stride(2) == 1, f"x: [T, h, D] with contiguous last dim, got {tuple(x.shape)}")
    T, H, D = x.shape
    half = cos.shape[1]
    rope = 2 * half
    check(rope <= D and half & (half - 1) == 0, f"rope width {rope} must be a power of two <= {D}")
    check(cos.shape == sin.shape and cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride()
          and cos.stride(1) == 1, "cos, sin: fp32 [max_pos, rope/2], same strides")  # fmt: skip
    check(positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64), f"positions: int [{T}]")
    if T == 0:
        return x
    bh = 16
    rope_inplace_kernel[(T, (H + bh - 1) // bh)](
        x, x.stride(0), x.stride(1), H, positions, cos, sin, cos.stride(0),
        D=D, ROPE=rope, BH=bh, SIGN=-1.0 if inverse else 1.0, num_warps=4,
    )  # fmt: skip
    return x
