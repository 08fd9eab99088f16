"""mHC residual streams for the SGLang model: parameters named as the checkpoint, fp32 math. Two computes,
chosen per call by `layers.impl.use_kernels`: the Triton kernels (`kernels.mhc`; per site one fp32 GEMM and
one fused kernel, which also applies the RMSNorm that follows the site) or torch (`layers.mhc_torch`, CPU
servers). Both have static shapes and work per token.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mhc_torch
from .impl import use_kernels


class HyperConnection(nn.Module):
    """One mHC site (`attn_hc` / `ffn_hc`): fn [(2+n)n, nH], base [(2+n)n], scale [3], all fp32."""

    def __init__(self, n: int, hidden: int, *, hc_eps: float, iters: int, rms_eps: float):
        super().__init__()
        rows = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(rows, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.hc_eps, self.iters, self.rms_eps = hc_eps, iters, rms_eps

    def pre(
        self, R: torch.Tensor, norm: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R [T, n, H] fp32 -> y [T, H] fp32 (before the site's RMSNorm), post [T, n], C [T, n, n] (fp32,
        contiguous). With `norm` (the sub-layer's SGLang RMSNorm): its fp32 norm of y rounded once to `dtype`
        in place of y (`attention.norm_fp32`), on the kernels in the site's tail launch."""
        kw = dict(hc_eps=self.hc_eps, iters=self.iters, rms_eps=self.rms_eps)
        if use_kernels(R):
            from ..kernels import mhc as K

            return K.hc_pre(_streams(R), self.fn, self.base, self.scale, norm=_fused(norm, dtype), **kw)
        y, post, C = mhc_torch.hc_pre(_streams(R), self.fn, self.base, self.scale, **kw)
        return _norm(y, norm, dtype), post, C

    @staticmethod
    def post(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """R'[i] = post[i] * f + sum_j C[j, i] R[j] (fp32)."""
        if use_kernels(R):
            from ..kernels import mhc as K

            if f.stride(-1) != 1:
                f = f.contiguous()
            return K.hc_post(f, _streams(R), post.float().contiguous(), C.float().contiguous())
        return mhc_torch.hc_post(f, _streams(R), post, C)


class HyperHead(nn.Module):
    """`model.hc_head`: fn [n, nH], base [n], scale [1] (fp32); collapses the streams to [T, H]."""

    def __init__(self, n: int, hidden: int, *, hc_eps: float, rms_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_eps, self.rms_eps = hc_eps, rms_eps

    def forward(
        self, R: torch.Tensor, norm: nn.Module | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """R [T, n, H] -> y [T, H] fp32; with `norm`, its norm of y in `dtype` (as `HyperConnection.pre`)."""
        kw = dict(hc_eps=self.hc_eps, rms_eps=self.rms_eps)
        if use_kernels(R):
            from ..kernels import mhc as K

            return K.hc_head(_streams(R), self.fn, self.base, self.scale, norm=_fused(norm, dtype), **kw)
        return _norm(mhc_torch.hc_head(_streams(R), self.fn, self.base, self.scale, **kw), norm, dtype)


def _fused(norm: nn.Module | None, dtype: torch.dtype | None):
    """The tail kernel's form of the sub-layer norm (None: no norm)."""
    if norm is None:
        return None
    from ..kernels.mhc import SublayerNorm

    return SublayerNorm(norm.weight, norm.variance_epsilon, dtype or torch.float32)


def _norm(y: torch.Tensor, norm: nn.Module | None, dtype: torch.dtype | None) -> torch.Tensor:
    """The torch compute's sub-layer norm of y (None: y)."""
    if norm is None:
        return y
    from .attention import norm_fp32

    return norm_fp32(norm, y, dtype)


def _streams(R: torch.Tensor) -> torch.Tensor:
    """Both computes' operand: fp32 [T, n, H] with a contiguous last dim (the model's streams already are)."""
    if R.dtype != torch.float32:
        R = R.float()
    return R if R.stride(-1) == 1 else R.contiguous()
