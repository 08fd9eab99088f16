"""Launcher-side glue: a `Geometry` as the constexpr / runtime arguments of the Triton pool readers."""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from ..checkpoint.spec import FP8_DTYPE
from .layout import Geometry, KVLayout

MIN_DOT_WIDTH = 16  # the smallest K / N of a tl.dot operand on the GPU


def padded(width: int, tile: int = 1) -> int:
    """The register width of a `width`-wide row inside the kernels: the next power of two (tl.arange needs one),
    at least MIN_DOT_WIDTH (a dot operand) and at least `tile` (fp8 rows are reshaped into whole scale tiles).
    Equal to `width` for the power-of-two widths of the full-size and tiny models, where the masks that cover
    the padding compile away (they sit behind `MAIN_P != MAIN`-style constexpr tests)."""
    return max(triton.next_power_of_2(max(width, 1)), MIN_DOT_WIDTH, tile)


@dataclasses.dataclass(frozen=True)
class PoolArgs:
    kind: int  # 0 bf16, 1 fp8 + ue8m0 bytes, 2 fp8 + fp32 scales
    main: int  # width of the main segment (values per token before the bf16 tail)
    main_p: int  # its register width (padded(main, tile)); dims main .. main_p - 1 are masked
    nope: int  # dims of main stored as fp8 (0 for bf16 layouts)
    tile: int  # values per scale (a power of two dividing main_p)
    tail: int  # bf16 tail width (0: none)
    tail_p: int  # its register width (padded(tail); 0 without a tail)
    tail_off: int  # byte offset of the tail inside the data row
    page_size: int
    page_bytes: int
    data_stride: int
    scale_base: int
    scale_stride: int


def pool_args(g: Geometry) -> PoolArgs:
    """The constexpr / runtime arguments of a pool's readers and writers. Any even widths: a row is held in
    registers at its padded width (`padded`) and the dims past the real width are masked on every load and
    store; scale tiles stay whole (HCA fp8 needs (dim - rope) % 64 == 0, MLA fp8 latent % 128 == 0: the
    layouts' own rule, kernels/layout.py `fp8_unfit`). The indexer fp8 key has one scale per token, so its
    tile is the padded row (the masked dims are zero and do not change the amax)."""
    L = g.layout
    if L is KVLayout.HCA_FP8:
        a = (1, g.dim, g.nope, g.tile, 0, 0)
    elif L in (KVLayout.HCA_BF16, KVLayout.IDX_BF16):
        a = (0, g.dim, 0, 0, 0, 0)
    elif L is KVLayout.MLA_FP8:
        a = (2, g.dim, g.dim, g.tile, g.rope, g.dim + 4 * (g.dim // g.tile))
    elif L is KVLayout.MLA_BF16:
        a = (0, g.dim, 0, 0, g.rope, 2 * g.dim)
    elif L is KVLayout.IDX_FP8:
        a = (2, g.dim, g.dim, 0, 0, 0)
    else:
        raise ValueError(L)
    kind, main, nope, tile, tail, tail_off = a
    main_p = padded(main, tile)
    if L is KVLayout.IDX_FP8 or kind == 0:
        tile = main_p  # one scale per token (IDX_FP8); unused for bf16 layouts
    assert tile & (tile - 1) == 0 and main_p % tile == 0, f"{L.value}: scale tile {tile} must tile {main_p}"
    return PoolArgs(
        kind,
        main,
        main_p,
        nope,
        tile,
        tail,
        padded(tail) if tail else 0,
        tail_off,
        g.page_size,
        g.page_bytes,
        g.data_stride,
        g.scale_base,
        g.scale_stride,
    )


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
