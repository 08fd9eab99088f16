"""Pure-PyTorch twins of the paged-cache plumbing the kernels do: byte encodings of the KV pools
(kernels/layout.py, docs/kv-layout.md), slot gathers, and the per-request compositions of the
model math. Only composes `functional` / `rope` / `mhc`: no second copy of the math lives here.

Quantisation (all fp8 pools): per tile, scale = 2**e with e = ceil(log2(max(amax, 1e-8) / 448))
(computed in float64, i.e. exactly); value = e4m3(clamp(x / 2**e, +-448)) (round to nearest even).
HCA_FP8 stores e + 127 as one ue8m0 byte; MLA_FP8 / IDX_FP8 store 2**e as fp32.
"""

from __future__ import annotations

import torch

from ..reference import functional as F
from .layout import FP8_AMAX_EPS, FP8_DTYPE, FP8_MAX, Geometry, KVLayout

# ----------------------------------------------------------------------------- fp8 tiles


def quant_pow2(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (e4m3 [N, D], exponent e [N, D // tile] int32) with x ~= q * 2**e per tile."""
    N, D = x.shape
    xt = x.float().view(N, D // tile, tile)
    amax = xt.abs().amax(-1).clamp_min(FP8_AMAX_EPS)
    e = torch.ceil(torch.log2(amax.double() / FP8_MAX)).to(torch.int32)
    scale = torch.pow(2.0, e.double()).float()
    q = (xt / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(N, D), e


def dequant_pow2(q: torch.Tensor, e: torch.Tensor, tile: int) -> torch.Tensor:
    N, D = q.shape
    return (q.float().view(N, D // tile, tile) * torch.pow(2.0, e.double()).float()[..., None]).view(N, D)


# ----------------------------------------------------------------------------- paged pools


def _rows(pool: torch.Tensor, g: Geometry, slots: torch.Tensor, base: int, stride: int, nbytes: int):
    """[N, nbytes] int64 byte offsets into pool.view(-1) of each slot's field."""
    slots = slots.long()
    page, off = slots // g.page_size, slots % g.page_size
    start = page * g.page_bytes + base + off * stride
    return start[:, None] + torch.arange(nbytes, device=slots.device)


def encode_tokens(g: Geometry, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, width] (width = dim for HCA / indexer, dim + rope for MLA) -> (data bytes [N, data],
    scale bytes [N, scale] or None) as the pool stores them."""
    N = x.shape[0]
    if g.layout in (KVLayout.HCA_BF16, KVLayout.MLA_BF16, KVLayout.IDX_BF16):
        return x.to(torch.bfloat16).contiguous().view(torch.uint8).view(N, -1), None
    if g.layout is KVLayout.HCA_FP8:
        q, e = quant_pow2(x[:, : g.nope], g.tile)
        data = torch.cat(
            [q.view(torch.uint8), x[:, g.nope :].to(torch.bfloat16).contiguous().view(torch.uint8)], 1
        )
        sc = torch.zeros(N, g.scale_stride, dtype=torch.uint8, device=x.device)
        sc[:, : g.nope // g.tile] = (e + 127).to(torch.uint8)
        return data, sc
    if g.layout is KVLayout.MLA_FP8:
        q, e = quant_pow2(x[:, : g.dim], g.tile)
        s = torch.pow(2.0, e.double()).float().contiguous().view(torch.uint8).view(N, -1)
        rope = x[:, g.dim :].to(torch.bfloat16).contiguous().view(torch.uint8).view(N, -1)
        return torch.cat([q.view(torch.uint8), s, rope], 1), None
    if g.layout is KVLayout.IDX_FP8:
        q, e = quant_pow2(x, g.dim)
        return q.view(torch.uint8), torch.pow(2.0, e.double()).float().contiguous().view(torch.uint8).view(
            N, 4
        )
    raise ValueError(g.layout)


def pool_store(pool: torch.Tensor, g: Geometry, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write tokens x [N, width] at cache slots [N] (reference of the store kernels)."""
    flat = pool.view(-1)
    data, sc = encode_tokens(g, x)
    if g.layout is KVLayout.MLA_FP8 or sc is None:
        flat[_rows(pool, g, slots, 0, g.data_stride, data.shape[1])] = data
    else:
        flat[_rows(pool, g, slots, 0, g.data_stride, data.shape[1])] = data
        flat[_rows(pool, g, slots, g.scale_base, g.scale_stride, sc.shape[1])] = sc


def pool_gather(pool: torch.Tensor, g: Geometry, slots: torch.Tensor) -> torch.Tensor:
    """Dequantised tokens [N, width] fp32 at cache slots [N] (what every reader of the pool sees)."""
    flat = pool.view(-1)
    N = slots.shape[0]
    if g.layout in (KVLayout.HCA_BF16, KVLayout.MLA_BF16, KVLayout.IDX_BF16):
        b = flat[_rows(pool, g, slots, 0, g.data_stride, g.bytes_per_token)]
        return b.contiguous().view(torch.bfloat16).float().view(N, g.bytes_per_token // 2)
    if g.layout is KVLayout.HCA_FP8:
        b = flat[_rows(pool, g, slots, 0, g.data_stride, g.data_stride)].contiguous()
        e = flat[_rows(pool, g, slots, g.scale_base, g.scale_stride, g.nope // g.tile)].to(torch.int32) - 127
        nope = dequant_pow2(b[:, : g.nope].view(FP8_DTYPE), e, g.tile)
        rope = b[:, g.nope :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], 1)
    if g.layout is KVLayout.MLA_FP8:
        b = flat[_rows(pool, g, slots, 0, g.data_stride, g.bytes_per_token)].contiguous()
        nt = g.dim // g.tile
        s = b[:, g.dim : g.dim + 4 * nt].contiguous().view(torch.float32)
        lat = (b[:, : g.dim].view(FP8_DTYPE).float().view(N, nt, g.tile) * s[..., None]).view(N, g.dim)
        rope = b[:, g.dim + 4 * nt :].contiguous().view(torch.bfloat16).float()
        return torch.cat([lat, rope], 1)
    if g.layout is KVLayout.IDX_FP8:
        b = flat[_rows(pool, g, slots, 0, g.data_stride, g.dim)].contiguous()
        s = flat[_rows(pool, g, slots, g.scale_base, 4, 4)].contiguous().view(torch.float32)
        return b.view(FP8_DTYPE).float() * s
    raise ValueError(g.layout)


# ----------------------------------------------------------------------------- attention over pools


def sparse_attention(
    q: torch.Tensor, scopes: list[tuple[torch.Tensor, Geometry, torch.Tensor, torch.Tensor | None]],
    sink: torch.Tensor | None, scale: float, d_v: int,
) -> torch.Tensor:  # fmt: skip
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
    qI: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, g: Geometry, page_table: torch.Tensor,
    q_req: torch.Tensor, q_pos: torch.Tensor,
) -> list[torch.Tensor]:  # fmt: skip
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
    kvs: torch.Tensor, state: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor, eps: float,
    inv_freq: torch.Tensor, rope_dim: int, job_req_slot, job_block, job_ext_start, job_tok_start,
) -> torch.Tensor:  # fmt: skip
    """Compressed entries [J, D] fp32 (functional.hca_compress_block) of the jobs of
    kernels/hca_compress.py: row t of block j is kvs[tok_start + 128j + t - ext_start] when that
    position >= ext_start, else state[req_slot, (128 j) % ring + t] (ring = state.shape[1], 1 or 2 blocks)."""
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
