"""The byte-exact torch codec of the paged KV pools (kernels/layout.py): the pool stores and reads its rows
through it, the kernel tests compare the Triton kernels with it byte for byte, the test oracle rounds its KV
through it. fp8 tiles: scale 2**e, e = ceil(log2(max(amax, 1e-8) / 448)) (exact, in float64), value
e4m3(clamp(x / 2**e, +-448)); HCA_FP8 stores e + 127 as a ue8m0 byte, MLA_FP8 / IDX_FP8 store 2**e as fp32.
"""

from __future__ import annotations

import torch

from ..checkpoint.spec import FP8_DTYPE, FP8_MAX
from .layout import FP8_AMAX_EPS, Geometry, KVLayout

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
    scale bytes [N, scale] or None) as the pool stores them. Widths are spelled out: N may be 0 (an extend
    batch of no tokens stores nothing)."""
    N, width = x.shape
    if g.layout in (KVLayout.HCA_BF16, KVLayout.MLA_BF16, KVLayout.IDX_BF16):
        return x.to(torch.bfloat16).contiguous().view(torch.uint8).view(N, 2 * width), None
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
        s = torch.pow(2.0, e.double()).float().contiguous().view(torch.uint8).view(N, 4 * (g.dim // g.tile))
        rope = x[:, g.dim :].to(torch.bfloat16).contiguous().view(torch.uint8).view(N, 2 * (width - g.dim))
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
