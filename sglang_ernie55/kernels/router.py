"""Multi-router top-k for the latent MoE: s = mean_r sigmoid(x @ router_r^T) (fp32), ids = topk(s + bias, k)
(ties to the lower id), w = s[ids] / (sum s[ids] + 1e-20) (if norm_topk_prob) * routed_scaling_factor
(reference: `functional.multi_router_topk`). The router GEMM runs in cuBLAS, the rest in one fused program
per token; the result is what SGLang's `StandardTopKOutput` carries into FusedMoE.
"""

from __future__ import annotations

import logging

import torch
import triton

from ._pool import check
from ._triton.router import router_topk_kernel

logger = logging.getLogger(__name__)

# torch's bf16 GEMM with an fp32 output (`aten::mm.dtype`, CUDA); a torch without it takes the fp32 GEMM
_MM_FP32_OUT = "dtype" in torch.ops.aten.mm.overloads()
_BF16_GEMM_WORKS: dict[torch.device, bool] = {}


def bf16_gemm_works(device: torch.device) -> bool:
    """Whether `router_logits` may take the bf16 GEMM with fp32 output on `device`: the op exists and, checked
    once per device (eagerly: `Ernie55LatentMoE.router_matrix` asks before any CUDA-graph capture), runs and
    equals an fp64 GEMM of the same bf16 values to within 1e-4 of the largest logit (bf16 rounding would be
    2^-9 of it). Otherwise the fp32 GEMM, with a warning."""
    device = torch.device(device)
    if not _MM_FP32_OUT or device.type != "cuda":
        return False
    if device not in _BF16_GEMM_WORKS:
        if torch.cuda.is_current_stream_capturing():
            return False
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(37, 512, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(96, 512, device=device, generator=g).to(torch.bfloat16)
        try:
            got = torch.mm(x, w.t(), out_dtype=torch.float32)
            want = x.double() @ w.double().t()
            err = (got.double() - want).abs().max().item()
            ok = got.dtype == torch.float32 and err < 1e-4 * want.abs().max().item()  # bf16 out: ~2^-9
            bad = "" if ok else f"{got.dtype}, off by {err:.3g}"
        except RuntimeError as e:
            bad = f"{type(e).__name__}: {e}"
        if bad:
            logger.warning(
                "ERNIE-5.5 routers: torch's bf16 GEMM with fp32 output failed (%s); fp32 GEMM", bad
            )
        _BF16_GEMM_WORKS[device] = not bad
    return _BF16_GEMM_WORKS[device]


def router_logits(x: torch.Tensor, routers_cat: torch.Tensor) -> torch.Tensor:
    """[T, R*E] fp32 = x @ routers_cat^T with fp32 products and sums (routers_cat = torch.cat(routers),
    [R*E, H]). bf16 x and routers on CUDA (`bf16_gemm_works`): one cuBLAS bf16 GEMM that accumulates and
    writes fp32. A product of two bf16 values is exact in fp32 and the tensor cores add them in fp32 with a
    few guard bits fewer than IEEE (3e-5 off at most for logits up to ~6 over 4096 terms, against a few 1e-6
    for the fp32 GEMM; bf16 rounding would be ~1e-2), at the bf16 rate instead of fp32 SIMT: a 32K prompt's
    routers took 16.2 ms in fp32 on the H100, 1.1 ms this way. Else fp32."""
    if x.dtype == torch.bfloat16 and routers_cat.dtype == torch.bfloat16 and bf16_gemm_works(x.device):
        return torch.mm(x, routers_cat.t(), out_dtype=torch.float32)
    return x.float() @ routers_cat.float().t()


def multi_router_topk(
    logits: torch.Tensor,
    num_routers: int,
    bias: torch.Tensor,
    topk: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, R*E] (router-major: columns r*E .. r*E+E-1 are router r), bias fp32 [E].
    Returns (topk_weights fp32 [T, topk], topk_ids int32 [T, topk]); ids in descending biased score."""
    check(
        logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, "logits: fp32 [T, R*E]"
    )
    T, RE = logits.shape
    check(RE % num_routers == 0, f"logits width {RE} is not num_routers * E")
    E = RE // num_routers
    check(bias.shape == (E,) and bias.dtype == torch.float32 and bias.is_contiguous(), f"bias: fp32 [{E}]")
    check(1 <= topk <= E, f"topk {topk} out of range for {E} experts")
    w = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    if T:
        router_topk_kernel[(T,)](
            logits,
            logits.stride(0),
            bias,
            w,
            ids,
            E,
            float(scaling),
            R=num_routers,
            EP=triton.next_power_of_2(E),
            K=topk,
            KP=triton.next_power_of_2(topk),
            NORM=norm_topk_prob,
            num_warps=4,
        )
    return w, ids
