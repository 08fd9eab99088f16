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
        self, R: torch.Tensor, norm: nn.Module | None = None, dtype: torch.dtype | None = None, mixed=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R [T, n, H] fp32 -> y [T, H] fp32 (before the site's RMSNorm), post [T, n], C [T, n, n] (fp32,
        contiguous). With `norm` (the sub-layer's SGLang RMSNorm): its fp32 norm of y rounded once to `dtype`
        in place of y (`attention.norm_fp32`), on the kernels in the site's tail launch. `mixed`: this site's
        mix of R from the previous site's `post_mix` (None: the site mixes R itself)."""
        kw = dict(hc_eps=self.hc_eps, iters=self.iters, rms_eps=self.rms_eps)
        if use_kernels(R):
            from ..kernels import mhc as K

            norm = _fused(norm, dtype)
            return K.hc_pre(_streams(R), self.fn, self.base, self.scale, norm=norm, mixed=mixed, **kw)
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

    @classmethod
    def post_mix(cls, f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor, then: nn.Module):
        """`post`, and with it the mix of R' for `then` (the next site: a HyperConnection or the HyperHead)
        where the kernels serve this batch and `kernels.mhc.post_mixes` holds. Returns (R', `then`'s `mixed`
        or None)."""
        if use_kernels(R):
            from ..kernels import mhc as K

            if K.post_mixes(R.shape[0], R.shape[1]):
                f = f if f.stride(-1) == 1 else f.contiguous()
                return K.hc_post_mix(
                    f, _streams(R), post.float().contiguous(), C.float().contiguous(), then.fn
                )
        return cls.post(f, R, post, C), None


class HyperHead(nn.Module):
    """`model.hc_head`: fn [n, nH], base [n], scale [1] (fp32); collapses the streams to [T, H]."""

    def __init__(self, n: int, hidden: int, *, hc_eps: float, rms_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.hc_eps, self.rms_eps = hc_eps, rms_eps

    def forward(
        self, R: torch.Tensor, norm: nn.Module | None = None, dtype: torch.dtype | None = None, mixed=None
    ) -> torch.Tensor:
        """R [T, n, H] -> y [T, H] fp32; with `norm`, its norm of y in `dtype` (as `HyperConnection.pre`, and
        `mixed` too)."""
        kw = dict(hc_eps=self.hc_eps, rms_eps=self.rms_eps)
        if use_kernels(R):
            from ..kernels import mhc as K

            norm = _fused(norm, dtype)
            return K.hc_head(_streams(R), self.fn, self.base, self.scale, norm=norm, mixed=mixed, **kw)
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
