"""mHC residual streams for the SGLang model: parameters named as the checkpoint, fp32 torch math.

The math is the reference's (`sglang_ernie55.reference.mhc`), called on fp32 streams; every op has a
static shape, so it records into decode CUDA graphs. SGLang's own mHC kernels need TileLang or
DeepGEMM, which the lent runtime lacks; helper-4's Triton mHC replaces these calls when it lands.
"""

from __future__ import annotations

import torch
from torch import nn

from ..reference import mhc as ref


class HyperConnection(nn.Module):
    """One mHC site (`attn_hc` / `ffn_hc`): fn [(2+n)n, nH], base [(2+n)n], scale [3], all fp32."""

    def __init__(self, n: int, hidden: int, *, hc_eps: float, iters: int, rms_eps: float):
        super().__init__()
        rows = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(rows, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.hc_eps, self.iters, self.rms_eps = hc_eps, iters, rms_eps

    def pre(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R [T, n, H] fp32 -> y [T, H] fp32 (before the site's RMSNorm), post [T, n], C [T, n, n]."""
        return ref.hc_pre(R, self.fn, self.base, self.scale, hc_eps=self.hc_eps, iters=self.iters,
                          rms_eps=self.rms_eps)  # fmt: skip

    @staticmethod
    def post(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """R'[i] = post[i] * f + sum_j C[j, i] R[j] (fp32)."""
        return ref.hc_post(f, R, post, C)


class HyperHead(nn.Module):
    """`model.hc_head`: fn [n, nH], base [n], scale [1] (fp32); collapses the streams to [T, H]."""

    def __init__(self, n: int, hidden: int, *, hc_eps: float, rms_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_eps, self.rms_eps = hc_eps, rms_eps

    def forward(self, R: torch.Tensor) -> torch.Tensor:
        return ref.hc_head(R, self.fn, self.base, self.scale, hc_eps=self.hc_eps, rms_eps=self.rms_eps)
