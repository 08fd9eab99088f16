"""Which compute runs the model's per-layer work outside attention (`SGLANG_ERNIE55_LAYER_IMPL`: `auto`,
`torch`, `triton`; docs/server-args.md): mHC sites and hc_head, MoE routing, fp32 RMSNorms, RoPE.
The choice is made per call from the tensor's device (host-side: no sync, nothing recorded into a graph), so
a CPU server keeps the torch path and the same model object runs the kernels on CUDA. Every kernel is
row-wise with fixed-shape outputs: decode stays graph-capturable and batch-invariant.
"""

from __future__ import annotations

import logging

import torch

from ..envs import layer_impl

logger = logging.getLogger(__name__)

TORCH, TRITON = "torch", "triton"


def _interpreting() -> bool:
    from ..kernels._pool import interpreting

    return interpreting()


_DESCRIBE = {
    "auto": "the Triton kernels for CUDA tensors, torch for CPU tensors",
    TORCH: "torch",
    TRITON: "the Triton kernels (forced)",
}


def check_layer_impl() -> str:
    """Validate SGLANG_ERNIE55_LAYER_IMPL now (the model calls it when it is built, so that a bad value
    fails at start-up, not at the first forward) and log the choice. Returns the value."""
    v = layer_impl()
    logger.info(
        "ernie55 layer compute: SGLANG_ERNIE55_LAYER_IMPL=%s (mHC, MoE routing, norms, RoPE on %s)",
        v,
        _DESCRIBE[v],
    )
    return v


def use_kernels(t: torch.Tensor) -> bool:
    """Whether this call runs on the Triton kernels (see the module table)."""
    v = layer_impl()
    if v == TORCH:
        return False
    if t.is_cuda:
        return True
    if v == TRITON:
        if _interpreting():
            return True
        raise ValueError(
            f"SGLANG_ERNIE55_LAYER_IMPL=triton: a tensor on {t.device} and no Triton interpreter (the kernels run "
            "on CUDA, or on CPU under TRITON_INTERPRET=1). Legal values: auto, torch, triton (auto picks torch on CPU)"
        )
    return False
