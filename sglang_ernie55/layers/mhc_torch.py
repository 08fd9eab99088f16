"""The serving torch compute of the mHC sites and `hc_head` (CPU servers, SGLANG_ERNIE55_LAYER_IMPL=torch).

The mHC block for a batch of rows: fixed shapes (a decode CUDA graph captures it, T = 0 included), no host
sync, fp32, every row independent of the others. Operations and their order are the oracle's
(`reference/mhc.py`), so both give the same bits; tests compare the two.
"""

from __future__ import annotations

import torch


def mix(R: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """m = (x @ fn^T) * rsqrt(mean(x^2) + eps), x = R [T, n, H] flattened stream-major -> [T, rows(fn)]."""
    x = R.flatten(1)
    return (x @ fn.t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)


def sinkhorn_(C: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Logits [T, n, n] -> the mixing matrices, in place: softmax over each row + eps, columns normalised,
    then (iters - 1) x (rows, columns), each divided by (its sum + eps)."""
    C = torch.softmax(C, dim=-1).add_(eps)
    C.div_(C.sum(-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        C.div_(C.sum(-1, keepdim=True).add_(eps))
        C.div_(C.sum(-2, keepdim=True).add_(eps))
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
    """R [T, n, H] fp32 -> y [T, H] (before the site's RMSNorm), post [T, n], C [T, n, n] (C[j, i]: weight of
    stream j into stream i), all fp32. fn [(2+n)n, nH], base [(2+n)n], scale [3], fp32."""
    T, n = R.shape[0], R.shape[1]
    m = mix(R, fn, rms_eps)
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    C = sinkhorn_((m[:, 2 * n :] * scale[2] + base[2 * n :]).view(T, n, n), iters, hc_eps)
    y = (pre[..., None] * R).sum(-2)
    return y, post, C


def hc_post(f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """R'[i] = post[i] * f + sum_j C[j, i] R[j] (fp32). f [T, H] in the model dtype, R [T, n, H] fp32."""
    return post[..., None] * f.float()[:, None, :] + torch.einsum("tji,tjh->tih", C, R)


def hc_head(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
) -> torch.Tensor:
    """y = sum_i (sigmoid(m_i * scale + base_i) + eps) R[i] -> [T, H] fp32; fn [n, nH], base [n], scale [1]."""
    pre = torch.sigmoid(mix(R, fn, rms_eps) * scale[0] + base) + hc_eps
    return (pre[..., None] * R).sum(-2)
