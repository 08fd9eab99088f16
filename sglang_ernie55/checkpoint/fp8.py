"""Block-wise FP8 (e4m3) weights: W[i, j] = W_fp8[i, j].float() * scale_inv[i // 128, j // 128], one fp32
scale per FP8_BLOCK x FP8_BLOCK block, ragged edge blocks included. `Fp8Pairs` pairs a streamed `X.weight`
with its `X.weight_scale_inv` and dequantizes the pair, as both SGLang model classes do for the Linears they
keep unquantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .spec import FP8_BLOCK, FP8_DTYPE, FP8_MAX, SCALE_SUFFIX


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] (any float dtype) -> (codes float8_e4m3fn [rows, cols], scale_inv fp32 [rb, cb]).

    scale = amax(|block|) / 448, so every block uses the full e4m3 range (an all-zero block: scale 1);
    codes round W / scale to nearest even. Per element |W - deq(q(W))| <= max(|W| * 2^-4, scale * 2^-10)
    (3 mantissa bits, subnormal spacing 2^-9), up to the fp32 rounding of W / scale.
    """
    _check_2d("w", w)
    rows, cols = w.shape
    rb, cb = math.ceil(rows / block), math.ceil(cols / block)
    # Zero padding leaves every block's amax unchanged.
    wp = F.pad(w.float(), (0, cb * block - cols, 0, rb * block - rows)).view(rb, block, cb, block)
    amax = wp.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wp / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rb * block, cb * block)[:rows, :cols].contiguous(), scale.contiguous()


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> torch.Tensor:
    """codes [rows, cols] + scale_inv [ceil(rows/128), ceil(cols/128)] -> W (fp32 math, then `dtype`)."""
    _check_2d("q", q)
    _check_2d("scale_inv", scale_inv)
    rows, cols = q.shape
    want = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {(rows, cols)}: want {want}"
        )
    s = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (q.float() * s.to(q.device)).to(dtype)


class Fp8Pairs:
    """FP8 weights of a tensor stream, paired and dequantized.

    A checkpoint streams `X.weight` (float8_e4m3fn codes) and `X.weight_scale_inv` (fp32 block scales) in
    any order, possibly in different shards. `add` keeps each half until its partner arrives, then returns
    `(X.weight, W)` with W dequantized to `dtype_of(X.weight)`. What cannot be paired is named in `errors`:
    a half that comes twice, a scale whose shape does not tile its weight, and (`finish`) every weight or
    scale whose partner never came.
    """

    def __init__(self, dtype_of: Callable[[str], torch.dtype]):
        self.dtype_of = dtype_of
        self.errors: list[str] = []
        self._halves: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def is_half(name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor is half of an FP8 pair: a block scale, or FP8 codes."""
        return name.endswith(SCALE_SUFFIX) or tensor.dtype == FP8_DTYPE

    @staticmethod
    def weight_name(name: str) -> str:
        """`X.weight` for either half."""
        return name.removesuffix(SCALE_SUFFIX)

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Keep one half; once both halves of `X.weight` are here, (X.weight, W dequantized), else None."""
        w = self.weight_name(name)
        half = "scale" if name.endswith(SCALE_SUFFIX) else "codes"
        slot = self._halves.setdefault(w, {})
        if half in slot:
            self.errors.append(f"duplicate checkpoint tensor {name}")
            return None
        slot[half] = tensor
        if len(slot) < 2:
            return None
        del self._halves[w]
        try:
            return w, dequantize_fp8_block(slot["codes"], slot["scale"], self.dtype_of(w))
        except ValueError as e:
            self.errors.append(f"{w}{SCALE_SUFFIX}: {e}")
            return None

    def finish(self) -> list[str]:
        """Every error, the halves still waiting for their partner included."""
        waiting = [
            f"FP8 weight {w} came without its partner (weight / {SCALE_SUFFIX})" for w in sorted(self._halves)
        ]
        return self.errors + waiting
