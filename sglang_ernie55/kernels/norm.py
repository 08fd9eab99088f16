"""RMSNorm with fp32 math on rows of any float dtype: y = x * rsqrt(mean(x^2) + eps) [* weight], rounded
once to the output dtype (reference: `functional.rms_norm`). Row-wise and batch-invariant: one program handles
ROWS rows, a tile shape that depends on the row width only.
"""

from __future__ import annotations

import torch
import triton

from ._pool import check
from ._triton.norm import rms_norm_kernel

MAX_WIDTH = 16384


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [..., N] (fp32/bf16/fp16; last dim contiguous, rows may be strided in the leading dim of a 2-D x,
    e.g. a column slice); weight [N] (any float dtype) or None. Returns a new contiguous [..., N] tensor in
    ``out_dtype`` (default fp32)."""
    check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x: float dtype, got {x.dtype}")
    check(x.dim() >= 1 and x.stride(-1) == 1, f"x: last dim contiguous, got strides {x.stride()}")
    N = x.shape[-1]
    check(0 < N <= MAX_WIDTH, f"row width {N} out of range (1 .. {MAX_WIDTH})")
    if weight is not None:
        check(
            weight.shape == (N,) and weight.is_contiguous(),
            f"weight: contiguous [{N}], got {tuple(weight.shape)}",
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
            HAS_W=weight is not None,
            ROWS=rows,
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8,
        )
    return out
