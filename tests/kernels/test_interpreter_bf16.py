"""tests/shim_lib/triton_bf16.py: with it installed, a kernel's fp32 -> bf16 store in Triton's interpreter rounds as
the GPU's `cvt.rn.bf16.f32` and torch do (nearest, ties to even, carry into the exponent); uninstalled, the
interpreter's own conversion is back."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.shim_lib import triton_bf16

# the shim patches the interpreter only; compiled kernels take device pointers and round on the GPU itself
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks Triton's CPU interpreter (TRITON_INTERPRET=1)"
)


@triton.jit
def _cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n).to(y_ptr.dtype.element_ty), mask=i < n)


def _store_as(x: torch.Tensor, y: torch.Tensor) -> None:
    _cast[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))


def _bf16_ties_and_carries() -> torch.Tensor:
    """fp32 values exactly halfway between two bf16 values (even and odd low bits), just above / below halfway,
    values whose rounding carries into the exponent, and random ones."""
    g = torch.Generator().manual_seed(0)
    hi = torch.randint(0, 1 << 15, (256,), generator=g, dtype=torch.int32) | 0x3F800000  # [1, 2) bf16 patterns
    hi = hi & ~0xFFFF
    ties = hi | 0x8000
    near = torch.cat([ties + 1, ties - 1])
    carry = torch.tensor([0x3F7FFFFF, 0x3FFFFFFF, 0x407FC000, 0x7F7F8000], dtype=torch.int32)
    bits = torch.cat([ties, near, carry])
    vals = torch.cat([bits.view(torch.float32), torch.randn(512, generator=g) * 100])
    return torch.cat([vals, -vals])


def test_bf16_stores_round_as_the_gpu():
    x = _bf16_ties_and_carries()
    want = x.to(torch.bfloat16)
    y = torch.empty_like(want)
    assert triton_bf16.install() is None
    try:
        _store_as(x, y)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    finally:
        triton_bf16.uninstall()
    _store_as(x, y)
    assert not torch.equal(y.view(torch.int16), want.view(torch.int16))  # Triton's own interpreter conversion


def test_other_conversions_stay_tritons():
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    y = torch.empty(64, dtype=torch.float16)
    assert triton_bf16.install() is None
    try:
        _store_as(x, y)
        assert torch.allclose(y.float(), x, rtol=1e-3, atol=0)
        b = x.to(torch.bfloat16)
        back = torch.empty(64, dtype=torch.float32)
        _store_as(b, back)
        assert torch.equal(back, b.float())
    finally:
        triton_bf16.uninstall()
