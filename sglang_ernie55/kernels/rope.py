"""RoPE on a slice of the last dim of [T, h, D], in place: the HCA output's inverse rotation and the layers'
forward rotations (interleaved pairs (2i, 2i+1): HCA, MLA; rotate-half (i, i + r/2): the indexer), by
sign * position * inv_freq[i], cos / sin from `reference.rope.cos_sin` tables (reference: `reference.rope`).
"""

from __future__ import annotations

import torch

from ._pool import check
from ._triton.rope import rope_inplace_kernel


def rope_(
    x: torch.Tensor,
    positions: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    *,
    neox: bool = False,
    start: int | None = None,
) -> torch.Tensor:
    """x: [T, h, D] bf16/fp16/fp32, last dim contiguous (modified in place and returned);
    positions: int32/int64 [T] (rows of the tables), or None when cos / sin hold one row per token [T, r/2];
    cos, sin: fp32 [rows, r/2] with the same row stride, last dim contiguous; r = 2 * cos.shape[1] (a power
    of two); the rotated slice is x[..., start : start + r] (default: the last r dims). ``inverse`` rotates
    by -angle; ``neox`` pairs (i, i + r/2) instead of (2i, 2i+1)."""
    check(x.dim() == 3 and x.stride(2) == 1, f"x: [T, h, D] with contiguous last dim, got {tuple(x.shape)}")
    T, H, D = x.shape
    half = cos.shape[1]
    rope = 2 * half
    start = D - rope if start is None else start
    check(
        half & (half - 1) == 0 and 0 <= start and start + rope <= D,
        f"rope width {rope} must be a power of two fitting at {start} in {D}",
    )
    check(
        cos.shape == sin.shape
        and cos.dtype == sin.dtype == torch.float32
        and cos.stride() == sin.stride()
        and cos.stride(1) == 1,
        "cos, sin: fp32 [rows, rope/2], same strides",
    )
    if positions is None:
        check(cos.shape[0] >= T, f"cos, sin: one row per token ({T}), got {cos.shape[0]}")
    else:
        check(
            positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64), f"positions: int [{T}]"
        )
    if T == 0:
        return x
    bh = 16
    rope_inplace_kernel[(T, (H + bh - 1) // bh)](
        x,
        x.stride(0),
        x.stride(1),
        H,
        cos if positions is None else positions,
        cos,
        sin,
        cos.stride(0),
        START=start,
        ROPE=rope,
        BH=bh,
        SIGN=-1.0 if inverse else 1.0,
        NEOX=neox,
        TOKEN_ROWS=positions is None,
        num_warps=4,
    )
    return x
