"""mHC (manifold-constrained hyper-connections): n residual streams instead of one.

R [T, n, H]. Each sublayer site has fn [(2+n)n, nH] fp32, base [(2+n)n], scale [3]. All math in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


def hc_mix(R: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """m = (R.flatten(-1) @ fn^T) * rsqrt(mean(x^2) + eps), fp32. R [T, n, H] -> [T, rows(fn)]."""
    x = R.flatten(-2).float()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    return (x @ fn.float().t()) * r


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """C = softmax over rows + eps; cols normalised; then (iters-1) x (rows, cols). logits [..., n, n]."""
    C = torch.softmax(logits, dim=-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return C


def hc_pre(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    iters: int,
    rms_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns y [T, H] (fp32, before the sublayer's RMSNorm), post [T, n], C [T, n, n] (C[j, i]: j -> i)."""
    n = R.shape[-2]
    m = hc_mix(R, fn, rms_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    C = sinkhorn((m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n), iters, hc_eps)
    y = (pre[..., None] * R.float()).sum(-2)
    return y, post, C


def hc_post(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """R'[i] = post[i] * f + sum_j C[j, i] R[j]  (fp32 result). f [T, H]."""
    return post[..., None] * f.float()[:, None, :] + torch.einsum("tji,tjh->tih", C, R.float())


def hc_head(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
) -> torch.Tensor:
    """y = sum_i (sigmoid(m_i * scale + base_i) + eps) R[i]; fn [n, nH]. Returns y [T, H] fp32."""
    m = hc_mix(R, fn, rms_eps)
    pre = torch.sigmoid(m * scale.float()[0] + base.float()) + hc_eps
    return (pre[..., None] * R.float()).sum(-2)


class HcParams(nn.Module):
    """Holds one site's raw parameters: `fn`, `base`, `scale` (checkpoint names, no `.weight`)."""

    def __init__(self, rows: int, n: int, hidden: int, n_scales: int):
        super().__init__()
        self.fn = nn.Parameter(torch.zeros(rows, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(n_scales, dtype=torch.float32))
