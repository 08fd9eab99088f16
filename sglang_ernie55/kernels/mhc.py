"""mHC (manifold-constrained hyper-connections) on the GPU: hc_pre, hc_post, hc_head (formulas at `hc_pre`).

Backend ``"ours"`` (``"auto"``): a cuBLAS fp32 GEMM for the raw mix and one fused Triton tail per site;
``"sglang"``: SGLang's Triton pieces where they fit (hc_post is always ours). Both are tested against
`reference.mhc`. Each program works on one token's row, so results do not depend on the batch.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from .. import envs
from ._pool import check
from ._triton.mhc import hc_mix_kernel, hc_post_kernel, hc_post_mix_kernel, hc_pre_tail_kernel
from .norm import MAX_WIDTH

# the fused mix (`SGLANG_ERNIE55_MHC_MIX=fused`) for batches of this many tokens and more: its programs take
# MIX_CONFIG's rows each, so a decode batch would leave most SMs idle where cuBLAS splits K
FUSED_MIX_MIN_ROWS = 256
MIX_CONFIG = (32, 64, 4, 3)  # rows per program, K per step, warps, stages
# `hc_post_mix` holds each stream's tile in its own registers; its config is read as MIX_CONFIG (its four
# stream tiles and four IEEE dots per step spill at MIX_CONFIG on sm_90)
POST_MIX_STREAMS = 4
POST_MIX_CONFIG = (32, 64, 8, 2)


def _check_R(R: torch.Tensor, name: str = "R") -> tuple[int, int, int]:
    check(
        R.dim() == 3 and R.stride(2) == 1, f"{name}: [T, n, H] with contiguous last dim, got {tuple(R.shape)}"
    )
    check(R.dtype in (torch.float32, torch.bfloat16, torch.float16), f"{name}: float dtype, got {R.dtype}")
    return R.shape


def hc_mix(R: torch.Tensor, fn: torch.Tensor, rms_eps: float, backend: str = "ours") -> torch.Tensor:
    """m [T, rows(fn)] fp32 (see `hc_pre`)."""
    T, n, H = _check_R(R)
    check(fn.dim() == 2 and fn.shape[1] == n * H and fn.dtype == torch.float32, f"fn: fp32 [rows, {n * H}]")
    x = R.reshape(T, n * H)
    if backend == "sglang":
        from sglang.kernels.ops.layernorm.mhc import hc_mix_stats

        return hc_mix_stats(x.contiguous(), fn.contiguous(), rms_eps)
    xf = x.float()
    return (xf @ fn.t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)


def _raw_mix(R: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """x @ fn^T [T, rows] fp32 (the tail kernel applies the row's RMS factor)."""
    T, n, H = R.shape
    return R.reshape(T, n * H).float() @ fn.t()


def hc_mix_fused(
    R: torch.Tensor, fn: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ fn^T [T, rows] fp32, sum(x^2) per row [T] fp32) with x = R.flatten(-1), in one pass over R;
    config: (rows per program, K per step, warps, stages), default MIX_CONFIG."""
    T, n, H = _check_R(R)
    K = n * H
    NR, m, ss = _mix_outputs(fn, T, K, R.device)
    bm, bk, warps, stages = config or MIX_CONFIG
    x = R.reshape(T, K)  # a view where the streams of a token are contiguous
    if T:
        hc_mix_kernel[(triton.cdiv(T, bm),)](
            x,
            x.stride(0),
            fn,
            fn.stride(0),
            m,
            m.stride(0),
            ss,
            T,
            K,
            NR,
            NRP=max(16, triton.next_power_of_2(NR)),
            BM=bm,
            BK=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return m, ss


def _mix_outputs(fn: torch.Tensor, T: int, K: int, device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The fused mix's fn checks and its outputs: (rows of fn, m [T, rows] fp32, sums of squares [T] fp32)."""
    check(fn.dim() == 2 and fn.shape[1] == K and fn.dtype == torch.float32, f"fn: fp32 [rows, {K}]")
    check(fn.stride(1) == 1, "fn: contiguous rows")
    NR = fn.shape[0]
    m = torch.empty(T, NR, dtype=torch.float32, device=device)
    return NR, m, torch.empty(T, dtype=torch.float32, device=device)


def _fused_mix_serves(T: int, mix: str | None) -> bool:
    """Whether a batch of T tokens takes the fused mix (`mix` as `hc_pre`'s, None: the knob)."""
    mix = envs.mhc_mix() if mix is None else mix
    check(mix in envs.MHC_MIXES, f"mix: one of {envs.MHC_MIXES}, got {mix!r}")
    return mix == "fused" and T >= FUSED_MIX_MIN_ROWS


def _mix(R: torch.Tensor, fn: torch.Tensor, mix: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The raw mix and, from the fused pass, each row's sum of squares (None: the tail computes it)."""
    if _fused_mix_serves(R.shape[0], mix):
        return hc_mix_fused(R, fn)
    return _raw_mix(R, fn), None


def _check_mixed(mixed, T: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, ss = mixed
    check(m.shape == (T, rows) and m.dtype == torch.float32, f"mixed: m fp32 [{T}, {rows}]")
    check(ss.shape == (T,) and ss.dtype == torch.float32, f"mixed: sums of squares fp32 [{T}]")
    return m, ss


@dataclasses.dataclass(frozen=True)
class SublayerNorm:
    """The RMSNorm that follows an mHC site (the sub-layer's input norm, or the final norm after hc_head), done
    by the site's tail kernel: y * rsqrt(mean(y^2) + eps) [* weight] in fp32, rounded once to `out_dtype`."""

    weight: torch.Tensor | None
    eps: float
    out_dtype: torch.dtype


def _check_norm(norm: SublayerNorm | None, H: int) -> None:
    if norm is None:
        return
    # the whole row in one tile, as kernels.norm holds it
    check(H <= MAX_WIDTH, f"fused sub-layer norm: row width {H} > {MAX_WIDTH}")
    check(
        norm.out_dtype in (torch.float32, torch.bfloat16, torch.float16),
        f"fused sub-layer norm: float out_dtype, got {norm.out_dtype}",
    )
    w = norm.weight
    check(
        w is None or (w.shape == (H,) and w.is_contiguous()), f"fused sub-layer norm: weight contiguous [{H}]"
    )


def _tail(m, base, scale, R, out, pre, post, C, *, hc_eps, rms_eps, iters, head, rms, norm, ss=None) -> None:
    """One launch of `hc_pre_tail_kernel` over the T tokens of R (pre / post / C unused when `head`); `ss`:
    the rows' sums of squares from `hc_mix_fused` (the RMS factor without a pass over R)."""
    T, n, H = R.shape
    block = min(1024, triton.next_power_of_2(H))
    nblock = triton.next_power_of_2(H)
    w = norm.weight if norm is not None and norm.weight is not None else out
    hc_pre_tail_kernel[(T,)](
        m,
        m.stride(0),
        base,
        scale,
        R,
        R.stride(0),
        R.stride(1),
        H,
        pre,
        post,
        C,
        out,
        out.stride(0),
        float(hc_eps),
        float(rms_eps),
        w,
        float(norm.eps) if norm is not None else 0.0,
        ss if ss is not None else m,
        N=n,
        NP=triton.next_power_of_2(n),
        ITERS=iters,
        BLOCK=block,
        HEAD=head,
        RMS=rms,
        SS=ss is not None,
        NORM=norm is not None,
        HAS_W=norm is not None and norm.weight is not None,
        NBLOCK=nblock,
        num_warps=4 if norm is None or nblock <= 1024 else (8 if nblock <= 4096 else 16),
    )


def hc_pre(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    iters: int,
    rms_eps: float,
    backend: str = "auto",
    norm: SublayerNorm | None = None,
    mix: str | None = None,
    mixed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """With x = R.flatten(-1) (fp32; C[j, i]: stream j -> i):

        m    = (x @ fn^T) * rsqrt(mean(x^2) + rms_eps)
        pre  = sigmoid(m[:n] s0 + b[:n]) + eps;  post = 2 sigmoid(m[n:2n] s1 + b[n:2n])
        C    = Sinkhorn(softmax_row(m[2n:] s2 + b[2n:]) + eps; iters);  y = sum_i pre[i] R[i]

    hc_post then gives R'[i] = post[i] f + sum_j C[j, i] R[j]; hc_head: y = sum_i (sigmoid(m s + b) + eps)[i] R[i].
    R [T, n, H] (fp32/bf16); fn fp32 [(2+n)n, nH]; base fp32 [(2+n)n]; scale fp32 [3].
    Returns y fp32 [T, H] (before the sublayer's RMSNorm), post fp32 [T, n], C fp32 [T, n, n]. With `norm`
    (backend "ours" only): the sub-layer's RMSNorm of y in the same launch, [T, H] in norm.out_dtype, in
    place of y. `mix` (backend "ours"): `envs.MHC_MIXES`, None for `SGLANG_ERNIE55_MHC_MIX`; `mixed`: the
    mix of R and its rows' sums of squares, made by the previous site's `hc_post_mix` with this site's fn."""
    T, n, H = _check_R(R)
    rows = (2 + n) * n
    check(fn.shape == (rows, n * H), f"fn: [{rows}, {n * H}], got {tuple(fn.shape)}")
    check(base.shape == (rows,) and base.dtype == torch.float32, f"base: fp32 [{rows}]")
    check(scale.shape == (3,) and scale.dtype == torch.float32, "scale: fp32 [3]")
    _check_norm(norm, H)
    check(norm is None or backend != "sglang", "hc_pre: the fused sub-layer norm needs backend 'ours'")
    check(mixed is None or backend != "sglang", "hc_pre: `mixed` needs backend 'ours'")
    if backend == "sglang":
        from sglang.kernels.ops.layernorm.mhc import _hc_split_sinkhorn_triton, mhc_combine

        m = hc_mix(R, fn, rms_eps, "sglang")
        pre, post, C = _hc_split_sinkhorn_triton(m[None], scale, base, n, iters, hc_eps)
        y = mhc_combine(R.reshape(T, n * H).contiguous(), pre[0].contiguous(), n, torch.float32)
        return y, post[0], C[0]
    check(fn.dtype == torch.float32, "fn: fp32")
    m, ss = _mix(R, fn, mix) if mixed is None else _check_mixed(mixed, T, rows)
    y = torch.empty(T, H, dtype=torch.float32 if norm is None else norm.out_dtype, device=R.device)
    pre = torch.empty(T, n, dtype=torch.float32, device=R.device)
    post = torch.empty(T, n, dtype=torch.float32, device=R.device)
    C = torch.empty(T, n, n, dtype=torch.float32, device=R.device)
    if T:
        _tail(
            m,
            base,
            scale,
            R,
            y,
            pre,
            post,
            C,
            hc_eps=hc_eps,
            rms_eps=rms_eps,
            iters=iters,
            head=False,
            rms=True,
            norm=norm,
            ss=ss,
        )
    return y, post, C


def hc_post(
    f: torch.Tensor, R: torch.Tensor, post: torch.Tensor, C: torch.Tensor, out: torch.Tensor | None = None
):
    """f [T, H] (sublayer output), R [T, n, H], post fp32 [T, n], C fp32 [T, n, n] (contiguous).
    Returns R' [T, n, H] in R's dtype (or ``out``)."""
    T, n, H = _check_post(f, R, post, C)
    if out is None:
        out = torch.empty_like(R)
    check(out.shape == R.shape and out.stride(2) == 1, "out: like R")
    if T:
        blk = min(1024, triton.next_power_of_2(H))
        hc_post_kernel[(T, triton.cdiv(H, blk))](
            f,
            f.stride(0),
            R,
            R.stride(0),
            R.stride(1),
            post,
            C,
            out,
            out.stride(0),
            out.stride(1),
            H,
            N=n,
            NP=triton.next_power_of_2(n),
            BLOCK=blk,
            num_warps=4,
        )
    return out


def _check_post(f, R, post, C) -> tuple[int, int, int]:
    T, n, H = _check_R(R)
    check(f.shape == (T, H) and f.stride(1) == 1, f"f: [{T}, {H}]")
    check(
        post.shape == (T, n) and post.dtype == torch.float32 and post.is_contiguous(),
        f"post: fp32 [{T}, {n}]",
    )
    check(C.shape == (T, n, n) and C.dtype == torch.float32 and C.is_contiguous(), f"C: fp32 [{T}, {n}, {n}]")
    return T, n, H


def post_mixes(T: int, n: int, mix: str | None = None) -> bool:
    """Whether `hc_post_mix` serves a site's post and the next site's mix for a batch of T tokens of n streams
    (`mix` as `hc_pre`'s): the fused mix's rule, since its programs are the fused mix's, at most
    POST_MIX_STREAMS streams."""
    return _fused_mix_serves(T, mix) and n <= POST_MIX_STREAMS


def hc_post_mix(
    f: torch.Tensor,
    R: torch.Tensor,
    post: torch.Tensor,
    C: torch.Tensor,
    fn: torch.Tensor,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`hc_post` (the same R' bits) and the next site's `hc_mix_fused` of R' in one pass: R' is written and
    the mix taken as its tiles go by, so the next site's pre reads the streams only for its combination. fn:
    the next site's fp32 [rows, nH]. Returns (R', (m [T, rows] fp32, sum of squares [T] fp32)), the pair for
    `hc_pre` / `hc_head`'s `mixed`; config as `hc_mix_fused`'s, default POST_MIX_CONFIG."""
    T, n, H = _check_post(f, R, post, C)
    check(n <= POST_MIX_STREAMS, f"hc_post_mix: at most {POST_MIX_STREAMS} streams, got {n}")
    NR, m, ss = _mix_outputs(fn, T, n * H, R.device)
    if out is None:
        out = torch.empty_like(R)
    check(out.shape == R.shape and out.stride(2) == 1, "out: like R")
    bm, bk, warps, stages = config or POST_MIX_CONFIG
    if T:
        hc_post_mix_kernel[(triton.cdiv(T, bm),)](
            f,
            f.stride(0),
            R,
            R.stride(0),
            R.stride(1),
            post,
            C,
            out,
            out.stride(0),
            out.stride(1),
            fn,
            fn.stride(0),
            m,
            m.stride(0),
            ss,
            T,
            H,
            NR,
            N=n,
            NRP=max(16, triton.next_power_of_2(NR)),
            BM=bm,
            BK=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return out, (m, ss)


def hc_head(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    backend: str = "auto",
    norm: SublayerNorm | None = None,
    mix: str | None = None,
    mixed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """R [T, n, H]; fn fp32 [n, nH]; base fp32 [n]; scale fp32 [1]. Returns y fp32 [T, H], or with `norm` the
    final RMSNorm of y in the same launch ([T, H] in norm.out_dtype; as `hc_pre`, `mix` and `mixed` too)."""
    T, n, H = _check_R(R)
    _check_norm(norm, H)
    check(
        fn.shape == (n, n * H) and base.shape == (n,) and scale.numel() >= 1,
        "hc_head params: fn [n, nH], base [n]",
    )
    check(
        fn.dtype == torch.float32 and base.dtype == torch.float32 and scale.dtype == torch.float32,
        "hc_head params: fp32",
    )
    fused = backend != "sglang"
    check(fused or mixed is None, "hc_head: `mixed` needs backend 'ours'")
    if mixed is not None:
        m, ss = _check_mixed(mixed, T, n)
    else:
        m, ss = _mix(R, fn, mix) if fused else (hc_mix(R, fn, rms_eps, "sglang"), None)
    y = torch.empty(T, H, dtype=torch.float32 if norm is None else norm.out_dtype, device=R.device)
    if T:
        _tail(
            m,
            base,
            scale,
            R,
            y,
            y,
            y,
            y,
            hc_eps=hc_eps,
            rms_eps=rms_eps,
            iters=1,
            head=True,
            rms=fused,
            norm=norm,
            ss=ss,
        )
    return y
