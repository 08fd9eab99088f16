"""Launcher-side glue: a `Geometry` as the constexpr / runtime arguments of the Triton pool readers."""

from __future__ import annotations

import dataclasses
import os

import torch
import triton.language as tl

from .layout import FP8_DTYPE, Geometry, KVLayout


@dataclasses.dataclass(frozen=True)
class PoolArgs:
    kind: int  # 0 bf16, 1 fp8 + ue8m0 bytes, 2 fp8 + fp32 scales
    main: int  # width of the main segment (power of two)
    nope: int  # dims of main stored as fp8 (0 for bf16 layouts)
    tile: int  # values per scale
    tail: int  # bf16 tail width (0: none)
    tail_off: int  # byte offset of the tail inside the data row
    page_size: int
    page_bytes: int
    data_stride: int
    scale_base: int
    scale_stride: int


def pool_args(g: Geometry) -> PoolArgs:
    L = g.layout
    if L is KVLayout.HCA_FP8:
        a = (1, g.dim, g.nope, g.tile, 0, 0)
    elif L in (KVLayout.HCA_BF16, KVLayout.IDX_BF16):
        a = (0, g.dim, 0, g.dim, 0, 0)
    elif L is KVLayout.MLA_FP8:
        a = (2, g.dim, g.dim, g.tile, g.rope, g.dim + 4 * (g.dim // g.tile))
    elif L is KVLayout.MLA_BF16:
        a = (0, g.dim, 0, g.dim, g.rope, 2 * g.dim)
    elif L is KVLayout.IDX_FP8:
        a = (2, g.dim, g.dim, g.dim, 0, 0)
    else:
        raise ValueError(L)
    kind, main, nope, tile, tail, tail_off = a
    assert main & (main - 1) == 0 and main % tile == 0, f"{L.value}: main width {main} must be a power of two"
    assert tail == 0 or tail & (tail - 1) == 0, f"{L.value}: rope width {tail} must be a power of two"
    return PoolArgs(kind, main, nope, tile, tail, tail_off, g.page_size, g.page_bytes, g.data_stride,
                    g.scale_base, g.scale_stride)  # fmt: skip


def check_pool(pool: torch.Tensor, g: Geometry, name: str) -> None:
    if (
        pool.dtype != torch.uint8
        or pool.dim() != 2
        or pool.shape[1] != g.page_bytes
        or not pool.is_contiguous()
    ):
        raise ValueError(
            f"{name}: expected a contiguous uint8 pool [num_pages, {g.page_bytes}] ({g.layout.value}, page "
            f"{g.page_size}), got {tuple(pool.shape)} {pool.dtype} contiguous={pool.is_contiguous()}"
        )


def pool_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8, e4m3, bf16, fp32) flat views of the same bytes."""
    flat = pool.view(-1)
    return flat, flat.view(FP8_DTYPE), flat.view(torch.bfloat16), flat.view(torch.float32)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_dtype(fp32: bool = False):
    """Dot operand dtype: bf16 on GPUs; fp32 when asked (fp32 activations: exactness runs; the kernels' dots
    then run in IEEE fp32, `input_precision="ieee"`) and under the CPU interpreter, whose bf16 dot is wrong."""
    return tl.float32 if fp32 or interpreting() else tl.bfloat16
