"""Triton body of kernels/router.py: multi-router sigmoid mean + bias + top-k + normalisation."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_topk_kernel(
    logit_ptr,
    logit_stride,
    bias_ptr,
    w_ptr,
    id_ptr,
    E,
    scaling,
    R: tl.constexpr,
    EP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    em = e < E
    s = tl.zeros([EP], tl.float32)
    for r in tl.static_range(R):
        s += tl.sigmoid(tl.load(logit_ptr + t * logit_stride + r * E + e, mask=em, other=0.0))
    s = s / R
    b = tl.where(em, s + tl.load(bias_ptr + e, mask=em, other=0.0), float("-inf"))
    k = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    ws = tl.zeros([KP], tl.float32)
    for j in tl.static_range(K):
        mx = tl.max(b, 0)
        pick = tl.min(tl.where(b == mx, e, EP), 0)  # ties: the lower expert id
        wj = tl.sum(tl.where(e == pick, s, 0.0), 0)
        ids = tl.where(k == j, pick, ids)
        ws = tl.where(k == j, wj, ws)
        b = tl.where(e == pick, float("-inf"), b)
    if NORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    tl.store(w_ptr + t * K + k, ws * scaling, mask=k < K)
    tl.store(id_ptr + t * K + k, ids, mask=k < K)
