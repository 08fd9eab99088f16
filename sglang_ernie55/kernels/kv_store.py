"""Write tokens into a paged KV pool in its byte layout: pool[loc[i]] = encode(x[i]) for loc[i] >= 0,
bf16 or fp8 tiles with power-of-two scales as kernels/layout.py states, the HCA rope dims and the MLA k_rope
in bf16 (`kv_store`); read them back dequantised (`kv_load`). References: `torch_twin.pool_store` (byte-exact),
`torch_twin.pool_gather`.
"""

from __future__ import annotations

import torch

from ._pool import check, check_pool, pool_args, pool_views
from ._triton.kv_store import kv_load_kernel, kv_store_kernel
from .layout import Geometry


def _launch(kernel, programs: int, head: tuple, pool: torch.Tensor, a, **constexprs) -> None:
    """Launch a pool kernel whose arguments are `head`, then the pool's four views and its `pool_args`."""
    u8, f8, bf, f32 = pool_views(pool)
    kernel[(programs,)](
        *head,
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
        num_warps=4,
        **constexprs,
    )


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
    _launch(
        kv_store_kernel,
        x.shape[0],
        (x, x.stride(0), loc),
        pool,
        a,
        SCALE_BYTES=g.scale_stride if a.kind == 1 else 0,
    )


KV_LOAD_ROWS = 16  # tokens per program of kv_load


def kv_load(
    pool: torch.Tensor,
    g: Geometry,
    loc: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read N tokens back, dequantised: out [N, W] (`dtype`; W as `kv_store`'s x) with out[i] the row of slot
    loc[i] (int32 / int64, -1: a row of zeros). Every stored value is exact in bf16 (fp8 values times
    power-of-two scales, bf16 values), so a bf16 out equals `torch_twin.pool_gather` rounded to bf16. `out`:
    rows to write them into (a [N, W] tensor of `dtype` with contiguous rows: a slice of a larger copy)."""
    a = pool_args(g)
    check_pool(pool, g, "kv_load.pool")
    check(loc.dim() == 1 and loc.dtype in (torch.int32, torch.int64), "kv_load.loc: int32/int64 [N]")
    check(loc.device == pool.device, "kv_load: pool and loc on one device")
    check(dtype in (torch.bfloat16, torch.float32), f"kv_load.dtype: bfloat16 or float32, got {dtype}")
    N = loc.shape[0]
    if out is None:
        out = torch.empty(N, a.main + a.tail, dtype=dtype, device=pool.device)
    check(
        out.shape == (N, a.main + a.tail) and out.dtype == dtype and out.stride(1) == 1,
        f"kv_load.out: {dtype} [{N}, {a.main + a.tail}] with contiguous rows",
    )
    if N == 0:
        return out
    _launch(kv_load_kernel, -(-N // KV_LOAD_ROWS), (out, out.stride(0), loc, N), pool, a, BN=KV_LOAD_ROWS)
    return out
