"""RMSNorm with fp32 math on rows of any float dtype: y = x * rsqrt(mean(x^2) + eps) [* weight], optionally
followed in the same launch by interleaved RoPE on the row's last dims (the HCA q / kv), rounded once to the
output dtype (reference: `functional.rms_norm`, `reference.rope.apply_rope_interleaved`). Row-wise and
batch-invariant: one program handles ROWS rows, a tile shape that depends on the row width only.
"""

from __future__ import annotations

import torch
import triton

from ._pool import check
from ._triton.norm import rms_norm_kernel

MAX_WIDTH = 16384


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [..., N] (fp32/bf16/fp16; last dim contiguous, rows may be strided in the leading dim of a 2-D x,
    e.g. a column slice); weight [N] (any float dtype) or None. Returns a new contiguous [..., N] tensor in
    ``out_dtype`` (default fp32).

    ``rope`` = (cos, sin), fp32 [T, r/2] with the same strides and contiguous rows, r a power of two <= N, T =
    x.shape[0]: the last r columns of every normed row of token t (x [T, N] or [T, h, N]) are rotated in the
    same launch by cos[t] / sin[t], interleaved pairs (2i, 2i+1) (the HCA q / kv convention, what
    `rope.rope_(y, None, cos, sin)` does to the normed y), before the one rounding to ``out_dtype``."""
    check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x: float dtype, got {x.dtype}")
    check(x.dim() >= 1 and x.stride(-1) == 1, f"x: last dim contiguous, got strides {x.stride()}")
    N = x.shape[-1]
    check(0 < N <= MAX_WIDTH, f"row width {N} out of range (1 .. {MAX_WIDTH})")
    if weight is not None:
        check(
            weight.shape == (N,) and weight.is_contiguous(),
            f"weight: contiguous [{N}], got {tuple(weight.shape)}",
        )
    heads, half = 1, 0
    if rope is not None:
        cos, sin = rope
        half = cos.shape[-1]
        heads = x[0].numel() // N if x.dim() > 1 and x.shape[0] else 1
        check(
            cos.dim() == 2
            and cos.shape == sin.shape
            and cos.dtype == sin.dtype == torch.float32
            and cos.stride() == sin.stride()
            and cos.stride(1) == 1,
            f"rope: cos, sin fp32 [T, r/2] with the same strides, got {tuple(cos.shape)} / {tuple(sin.shape)}",
        )
        check(
            x.dim() >= 2 and cos.shape[0] >= x.shape[0],
            f"rope: one cos / sin row per token ({x.shape[0] if x.dim() else 0}), got {cos.shape[0]}",
        )
        check(
            half > 0 and half & (half - 1) == 0 and 2 * half <= N,
            f"rope width {2 * half} must be a power of two <= the row width {N}",
        )
    lead = x.shape[:-1]
    if x.dim() == 2:
        x2 = x
    else:
        x2 = x.reshape(-1, N)  # a view when the leading dims are contiguous, else a copy
    M = x2.shape[0]
    out = torch.empty(*lead, N, dtype=out_dtype or torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(N)
        rows = max(1, min(16, 2048 // block))
        rms_norm_kernel[(triton.cdiv(M, rows),)](
            x2,
            x2.stride(0),
            weight if weight is not None else out,
            out,
            N,
            M,
            N,
            float(eps),
            rope[0] if rope is not None else out,
            rope[1] if rope is not None else out,
            rope[0].stride(0) if rope is not None else 0,
            heads,
            HAS_W=weight is not None,
            ROWS=rows,
            BLOCK=block,
            ROPE=2 * half,
            num_warps=4 if block <= 1024 else 8,
        )
    return out
