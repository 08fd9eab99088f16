"""The oracle of the paged kernels: the model math of `reference.functional` over KV rows as the pool holds them.

Per query, in plain loops: sparse attention over one or two paged scopes, the indexer's scores over a
request's pages, HCA compression jobs over a batch. Rows are read through `kernels.torch_twin`, so a kernel
is compared with exactly the bytes it reads; the math is composed from `functional`, never copied.
"""

from __future__ import annotations

import torch

from ..kernels.layout import Geometry
from ..kernels.torch_twin import pool_gather
from . import functional as F

# ----------------------------------------------------------------------------- attention over pools


def sparse_attention(
    q: torch.Tensor,
    scopes: list[tuple[torch.Tensor, Geometry, torch.Tensor, torch.Tensor | None]],
    sink: torch.Tensor | None,
    scale: float,
    d_v: int,
) -> torch.Tensor:
    """Per query t: one softmax (functional.sink_attention, K = V) over the union of every scope's
    keys pool[indices[t, :length[t]]] (entries == -1 skipped). q [T, h, D]; each scope is
    (pool, geometry, indices [T, K] int32, lengths [T] int32 or None). Returns [T, h, d_v] fp32."""
    outs = []
    for t in range(q.shape[0]):
        keys = []
        for pool, g, idx, ln in scopes:
            row = idx[t, : (int(ln[t]) if ln is not None else idx.shape[1])]
            row = row[row >= 0]
            keys.append(pool_gather(pool, g, row))
        kv = torch.cat(keys, 0)
        mask = torch.ones(1, kv.shape[0], dtype=torch.bool, device=q.device)
        outs.append(F.sink_attention(q[t : t + 1].float(), kv, mask, sink, scale)[0, :, :d_v])
    return torch.stack(outs)


def indexer_logits_paged(
    qI: torch.Tensor,
    w: torch.Tensor,
    pool: torch.Tensor,
    g: Geometry,
    page_table: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
) -> list[torch.Tensor]:
    """Per query t: I(t, s) for s = 0 .. q_pos[t] (functional.indexer_scores over the request's keys,
    read through page_table[q_req[t]]). Returns a list of [q_pos[t] + 1] fp32."""
    out = []
    for t in range(qI.shape[0]):
        L = int(q_pos[t]) + 1
        s = torch.arange(L, device=qI.device)
        slots = page_table[int(q_req[t])][s // g.page_size].long() * g.page_size + s % g.page_size
        out.append(F.indexer_scores(qI[t : t + 1], w[t : t + 1], pool_gather(pool, g, slots))[0])
    return out


# ----------------------------------------------------------------------------- HCA compression over a batch


def hca_compress_jobs(
    kvs: torch.Tensor,
    state: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_dim: int,
    job_req_slot,
    job_block,
    job_ext_start,
    job_tok_start,
) -> torch.Tensor:
    """Compressed entries [J, D] fp32 (functional.hca_compress_block) of the jobs of
    kernels/hca_compress.py (R = ape.shape[0]): row t of block j is kvs[tok_start + R j + t - ext_start] when
    that position >= ext_start, else state[req_slot, (R j + t) % ring] (ring = state.shape[1], 1 or 2 blocks)."""
    ratio, D = ape.shape
    ring = state.shape[1]
    out = []
    for s, j, e, t0 in zip(
        job_req_slot.tolist(), job_block.tolist(), job_ext_start.tolist(), job_tok_start.tolist()
    ):
        rows = []
        for t in range(ratio):
            p = ratio * j + t
            rows.append(kvs[t0 + p - e] if p >= e else state[s, p % ring])
        blk = torch.stack(rows).float()
        out.append(F.hca_compress_block(blk[:, :D], blk[:, D:], ape, norm_w, eps, j, inv_freq, rope_dim))
    return torch.stack(out) if out else kvs.new_zeros(0, D)
