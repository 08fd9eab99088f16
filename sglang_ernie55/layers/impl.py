"""Which compute runs the model's per-layer work outside attention (`SGLANG_ERNIE55_LAYER_IMPL`).

| value | mHC sites + hc_head, MoE routing, fp32 RMSNorms, RoPE run on |
| --- | --- |
| `auto` (default) | the Triton kernels (`sglang_ernie55.kernels`: `mhc`, `router`, `norm`, `rope`) for CUDA tensors, the layers' torch math for CPU tensors |
| `torch` | the layers' torch math everywhere (the CPU path; tests compare it and the kernels with the oracle, `sglang_ernie55.reference`) |
| `triton` | the Triton kernels (CUDA tensors, or any tensor under `TRITON_INTERPRET=1`, Triton's CPU interpreter); a CPU tensor without the interpreter raises `ValueError` |

The choice is made per call from the tensor's device (a host-side check: no sync, nothing recorded into a
CUDA graph), so a CPU server keeps the torch path and the same model object runs the kernels once on CUDA.
Every kernel is row-wise (one token's result never depends on the other tokens of the batch) and has
fixed-shape outputs, so decode stays CUDA-graph capturable and batch-invariant.
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
