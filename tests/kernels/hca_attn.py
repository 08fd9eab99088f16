"""HCA attention for decode and extend in one call: sparse_mqa_attention over the window pool and the
compressed pool with the per-head sink, then the inverse RoPE of the output's rope slice (in place). Serving
does not call it (its backend attends through `sparse_mqa_attention` and the layer applies the inverse RoPE);
the kernel tests use it to check that composition against the reference.

Formula (functional.sink_attention over the window + visible compressed entries, then
functional.hca_output's inverse rotation): for query t at position p_t,
    o[t, h] = sum_k exp(q.k / sqrt(D)) k / (sum_k exp(q.k / sqrt(D)) + exp(sink[h])),
    o[t, h, D - rope:] = RoPE^-1(o[t, h, D - rope:], p_t)
with k over the slots of window_idx[t, :window_len[t]] and cmp_idx[t, :cmp_len[t]] (-1 skipped);
`use_flashmla` runs the attention on `flashmla_sparse_attention` (fp8 V4 pools, 64 / 128 heads).
"""

from __future__ import annotations

import torch

from sglang_ernie55.kernels.rope import rope_
from sglang_ernie55.kernels.sparse_attn import Scope, flashmla_sparse_attention, sparse_mqa_attention


def hca_attention(
    q: torch.Tensor,
    window: Scope,
    compressed: Scope | None,
    sink: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    use_flashmla: bool = False,
    out: torch.Tensor | None = None,
    **tuning,
) -> torch.Tensor:
    """q bf16 [T, h, D] (D = window.geom.dim, already normed and rotated); window / compressed: Scopes
    over the HCA window pool and compressed pool (compressed None: window only, e.g. the ECHO draft);
    sink fp32 [h]; positions int [T]; cos / sin fp32 [max_pos, rope / 2]. Returns o [T, h, D] bf16."""
    D = window.geom.dim
    if use_flashmla:
        o, _ = flashmla_sparse_attention(q, window, compressed, sm_scale=D**-0.5, d_v=D, sink=sink)
        if out is not None:
            out.copy_(o)
            o = out
    else:
        o, _ = sparse_mqa_attention(
            q, window, compressed, sm_scale=D**-0.5, d_v=D, sink=sink, out=out, **tuning
        )
    return rope_(o, positions, cos, sin, inverse=True)
