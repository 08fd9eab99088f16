"""Block-128 FP8 weights (convention 12): exact round trips, per-block scales, ragged edges, error bound."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_ernie55.checkpoint.fp8 import FP8_MAX, Fp8Pairs, dequantize_fp8_block, quantize_fp8_block
from sglang_ernie55.checkpoint.spec import FP8_BLOCK, FP8_DTYPE

# whole blocks, ragged edges on either or both dims, single rows/cols, one element
AWKWARD = [(1, 1), (1, 300), (300, 1), (127, 129), (128, 128), (129, 257), (256, 384), (192, 256), (97, 989)]


def _codes_and_scales(shape, seed):
    """Random FP8 codes whose every block holds a +-448 code, and bf16-representable scales (so that
    amax / 448 reproduces the scale exactly in fp32)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    rb, cb = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    q = (torch.randn(shape, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    for i in range(rb):
        for j in range(cb):  # one full-range code per block, at a random spot inside it
            r = i * FP8_BLOCK + int(torch.randint(0, min(FP8_BLOCK, rows - i * FP8_BLOCK), (1,), generator=g))
            c = j * FP8_BLOCK + int(torch.randint(0, min(FP8_BLOCK, cols - j * FP8_BLOCK), (1,), generator=g))
            q[r, c] = torch.tensor(FP8_MAX if (i + j) % 2 else -FP8_MAX).to(FP8_DTYPE)
    scale = torch.exp(torch.randn(rb, cb, generator=g) * 3).to(torch.bfloat16).float()
    return q, scale


@pytest.mark.parametrize("shape", AWKWARD)
def test_round_trip_exact(shape):
    q, scale = _codes_and_scales(shape, seed=hash(shape) % 1000)
    w = dequantize_fp8_block(q, scale)
    q2, scale2 = quantize_fp8_block(w)
    assert q2.dtype == FP8_DTYPE and scale2.dtype == torch.float32
    assert scale2.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(scale2, scale)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize_fp8_block(q2, scale2), w)


@pytest.mark.parametrize("shape", [(129, 257), (300, 130)])
def test_every_element_uses_its_own_block_scale(shape):
    """Codes all 1.0, scale of block (i, j) = 1000 i + j + 1: W[r, c] must be the scale of its block."""
    rows, cols = shape
    rb, cb = math.ceil(rows / 128), math.ceil(cols / 128)
    scale = (torch.arange(rb)[:, None] * 1000 + torch.arange(cb)[None, :] + 1).float()
    w = dequantize_fp8_block(torch.ones(shape).to(FP8_DTYPE), scale)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(w, ((r // 128) * 1000 + (c // 128) + 1).float())


@pytest.mark.parametrize("shape", AWKWARD)
def test_quantization_error_bound_and_scale_rule(shape):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))  # wide dynamic range
    w = w.to(torch.bfloat16)
    q, scale = quantize_fp8_block(w)
    rows, cols = shape
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert scale[i, j] == blk.abs().max() / 448  # scale = amax / 448, ragged blocks too
    deq = dequantize_fp8_block(q, scale)
    s = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    # half an e4m3 step (normal: 2^-4 relative; subnormal: 2^-10 * scale), plus the fp32 rounding of W / scale
    bound = torch.maximum(w.float().abs() * 2.0**-4, s * 2.0**-10) * (1 + 2.0**-20)
    assert ((deq - w.float()).abs() <= bound).all()
    assert q.float().abs().max() <= FP8_MAX


def test_zero_block_and_dtype_out():
    w = torch.zeros(130, 130)
    w[129, 129] = 3.0
    q, scale = quantize_fp8_block(w)
    assert scale[0, 0] == 1.0 and scale[1, 1] == 3.0 / 448
    assert torch.equal(dequantize_fp8_block(q, scale), w)
    assert dequantize_fp8_block(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_scale_shape_mismatch_is_an_error():
    q, scale = quantize_fp8_block(torch.randn(129, 257))
    with pytest.raises(ValueError, match=r"scale_inv shape \(2, 2\).*want \(2, 3\)"):
        dequantize_fp8_block(q, scale[:, :2])


def test_pairs_dequantize_in_either_order_and_name_what_cannot_pair():
    """Fp8Pairs (both SGLang model classes' loaders): a weight and its scale pair in either order into the
    dequantized weight at the asked dtype; a repeated half, a scale of the wrong shape and a half whose
    partner never comes are named."""
    a, b = quantize_fp8_block(torch.randn(130, 200)), quantize_fp8_block(torch.randn(64, 64))
    pairs = Fp8Pairs(lambda w: torch.bfloat16 if w.startswith("a.") else torch.float32)
    assert Fp8Pairs.is_half("a.weight", a[0]) and Fp8Pairs.is_half("a.weight_scale_inv", a[1])
    assert not Fp8Pairs.is_half("a.weight", torch.zeros(2, dtype=torch.bfloat16))
    assert pairs.add("a.weight_scale_inv", a[1]) is None
    name, w = pairs.add("a.weight", a[0])
    assert name == "a.weight" and torch.equal(w, dequantize_fp8_block(*a, torch.bfloat16))
    name, w = pairs.add("b.weight", b[0]) or pairs.add("b.weight_scale_inv", b[1])
    assert name == "b.weight" and w.dtype == torch.float32 and torch.equal(w, dequantize_fp8_block(*b))
    assert pairs.finish() == []
    pairs.add("c.weight", a[0])
    pairs.add("c.weight", a[0])
    assert pairs.add("c.weight_scale_inv", b[1]) is None  # a 1x1 scale for a 130x200 weight
    pairs.add("d.weight_scale_inv", b[1])
    errors = pairs.finish()
    assert errors[0] == "duplicate checkpoint tensor c.weight"
    assert errors[1].startswith("c.weight_scale_inv: scale_inv shape (1, 1) does not match weight (130, 200)")
    assert errors[2:] == ["FP8 weight d.weight came without its partner (weight / _scale_inv)"]
