"""Write tokens into a paged KV pool in its byte layout: pool[loc[i]] = encode(x[i]) for loc[i] >= 0,
bf16 or fp8 tiles with power-of-two scales as kernels/layout.py states, the HCA rope dims and the MLA k_rope
in bf16. Reference: `torch_twin.pool_store` (byte-exact).
"""

from __future__ import annotations

import torch

from ._pool import check, check_pool, pool_args, pool_views
from ._triton.kv_store import kv_store_kernel
from .layout import Geometry


def kv_store(pool: torch.Tensor, g: Geometry, loc: torch.Tensor, x: torch.Tensor) -> None:
    """Store N tokens.

    pool: uint8 [num_pages, g.page_bytes], contiguous (modified in place).
    g:    the pool's Geometry (hca_geometry / mla_geometry / idx_geometry).
    loc:  [N] int32/int64 cache slots (page * page_size + offset); -1 skips the token.
    x:    [N, W] bf16/fp16/fp32, last dim contiguous; W = g.dim for HCA and indexer pools,
          g.dim + g.rope ([latent | k_rope]) for MLA pools (any even widths). Rope dims must already be rotated.
    """
    a = pool_args(g)
    check_pool(pool, g, "kv_store.pool")
    width = a.main + a.tail
    check(x.dim() == 2 and x.shape[1] == width, f"kv_store.x: expected [N, {width}], got {tuple(x.shape)}")
    check(x.stride(1) == 1, "kv_store.x: last dim must be contiguous")
    check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"kv_store.x: float dtype, got {x.dtype}"
    )
    check(
        loc.dim() == 1 and loc.shape[0] == x.shape[0],
        f"kv_store.loc: expected [{x.shape[0]}], got {tuple(loc.shape)}",
    )
    check(loc.dtype in (torch.int32, torch.int64), f"kv_store.loc: int32/int64, got {loc.dtype}")
    check(loc.device == pool.device == x.device, "kv_store: pool, loc and x on one device")
    if x.shape[0] == 0:
        return
    u8, f8, bf, f32 = pool_views(pool)
    kv_store_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        loc,
        u8,
        f8,
        bf,
        f32,
        a.page_size,
        a.page_bytes,
        a.data_stride,
        a.scale_base,
        a.scale_stride,
        KIND=a.kind,
        MAIN=a.main,
        MAIN_P=a.main_p,
        NOPE=a.nope,
        TILE=a.tile,
        TAIL=a.tail,
        TAIL_P=a.tail_p,
        TAIL_OFF=a.tail_off,
        SCALE_BYTES=g.scale_stride if a.kind == 1 else 0,
        num_warps=4,
    )
