"""fp32 RMSNorm kernel vs functional.rms_norm: widths of the model (tiny and full), weighted and weightless,
strided rows (a column slice), every output dtype, zero rows; rows are independent (batch invariance); with
the RoPE of the row's tail fused in, vs the norm then the reference rotation."""

import os

import pytest
import torch

from sglang_ernie55.kernels.norm import rms_norm
from sglang_ernie55.kernels.rope import rope_
from sglang_ernie55.reference import functional as F
from sglang_ernie55.reference import rope
from tests.kernels.kutil import DEV
from tests.shim_lib import triton_bf16


def _check(M, N, dtype, out_dtype, weighted, strided=False, scale=3.0):
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = (torch.randn(M, N + 64 if strided else N, generator=g) * scale).to(dtype)
    x = x[:, :N] if strided else x  # rows at stride N + 64 (the kv_a[:, :r] case)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(torch.bfloat16) if weighted else None
    want = F.rms_norm(x, w, 1e-6)
    if out_dtype is not None:
        want = want.to(out_dtype)
    xd = x.to(DEV)
    got = rms_norm(xd, None if w is None else w.to(DEV), 1e-6, out_dtype)
    assert got.dtype == (out_dtype or torch.float32) and got.shape == (M, N) and got.is_contiguous()
    if out_dtype in (None, torch.float32):
        torch.testing.assert_close(got.cpu(), want, atol=2e-6, rtol=2e-6)
    else:  # one rounding of the fp32 result: at most one bf16 ulp apart where the fp32 values straddle a tie
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=0, rtol=2**-7)
    return xd, w, got


@pytest.mark.parametrize("M", [0, 1, 3, 19, 130])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_tiny(M, weighted):
    _check(M, 256, torch.float32, None, weighted)
    _check(M, 192, torch.bfloat16, torch.bfloat16, weighted)  # q_lora of the tiny config: not a power of two
    _check(M, 128, torch.float32, torch.float32, weighted, strided=True)
    _check(M, 64, torch.float32, None, weighted, scale=1e-3)  # mean(x^2) ~ eps: eps must be where it belongs


@pytest.mark.parametrize("N", [48, 80, 96, 120, 144, 1100])
def test_rms_norm_odd_widths(N):
    """Row widths of issue 13's geometries (MLA latent 96, indexer 48, q_lora 144, o_lora 120, ...) and one
    wider than a 1024 block: the padded lanes must not enter the mean."""
    for M in (1, 19, 130):
        _check(M, N, torch.float32, None, True)
        _check(M, N, torch.float32, torch.float32, False, strided=True)
        _check(M, N, torch.bfloat16, torch.bfloat16, True)


def test_rms_norm_rows_are_independent():
    """A row's output is bit-identical whatever the other rows of the call are (batch invariance)."""
    x, w, full = _check(130, 256, torch.float32, torch.bfloat16, True)
    for t in (0, 17, 129):
        one = rms_norm(x[t : t + 1].clone(), w.to(DEV), 1e-6, torch.bfloat16)
        assert torch.equal(one[0], full[t])


def test_rms_norm_3d_heads():
    """[T, h, D] rows (the weightless per-head q norm)."""
    x = torch.randn(5, 16, 128, device=DEV)
    got = rms_norm(x, None, 1e-6)
    torch.testing.assert_close(got.cpu(), F.rms_norm(x.cpu(), None, 1e-6), atol=2e-6, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 97, 4096])
@pytest.mark.parametrize("N", [512, 1024, 4096])
def test_rms_norm_full(M, N):
    _check(M, N, torch.bfloat16, torch.bfloat16, True)
    _check(M, N, torch.float32, None, True)
    _check(M, N, torch.float32, torch.float32, False, strided=True)


def _rope_rows(T, half, g):
    inv = rope.yarn_inv_freq(2 * half, 160000.0, None)
    pos = torch.randint(0, 1 << 16, (T,), generator=g)
    c, s = rope.cos_sin(pos, inv)
    return pos, inv, c, s


@pytest.mark.parametrize("T", [0, 1, 3, 19, 130])
@pytest.mark.parametrize(
    "shape,rope_dim,weighted,strided",
    [
        ((256,), 64, True, True),  # the HCA kv: kv_norm over a column slice of the merged projection
        ((16, 128), 64, False, False),  # the HCA q: weightless per-head norm, [T, h, D]
        ((3, 96), 32, False, False),  # a padded head width (issue 13's head 96 / rope 32)
        ((112,), 16, True, True),
        ((1100,), 64, True, False),  # wider than a 1024 block
    ],
)
def test_rms_norm_rope_tail(T, shape, rope_dim, weighted, strided):
    """norm + interleaved RoPE on the last dims in one launch = functional.rms_norm, then the reference rotation
    of the tail at the token's position (per-token cos / sin rows, every head of a token at its row); fp32 out."""
    g = torch.Generator().manual_seed(T * 7 + shape[-1])
    N = shape[-1]
    x = torch.randn(T, *shape[:-1], N + (40 if strided else 0), generator=g) * 3.0
    x = x[..., :N] if strided else x
    w = (1 + 0.1 * torch.randn(N, generator=g)) if weighted else None
    pos, inv, c, s = _rope_rows(T, rope_dim // 2, g)
    want = F.rms_norm(x, w, 1e-6).float()
    want[..., -rope_dim:] = rope.apply_rope_interleaved(want[..., -rope_dim:], pos, inv)
    xd = x.to(DEV)
    got = rms_norm(xd, None if w is None else w.to(DEV), 1e-6, None, rope=(c.to(DEV), s.to(DEV)))
    assert got.shape == x.shape and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    # the same as the two launches it replaces (the norm, then rope_ in place on its output)
    heads = shape[0] if len(shape) == 2 else 1
    two = rope_(
        rms_norm(xd, None if w is None else w.to(DEV), 1e-6).view(T, heads, N), None, c.to(DEV), s.to(DEV)
    )
    torch.testing.assert_close(got.cpu(), two.view(got.shape).cpu(), atol=2e-6, rtol=2e-6)
    # rounded once to bf16 in the launch (the attention's query dtype): the fp32 result's bf16 cast, bit for
    # bit (in the interpreter with the GPU's rounding: its own conversion truncates, tests/shim_lib)
    shim = os.environ.get("TRITON_INTERPRET") == "1"
    if shim:
        assert triton_bf16.install() is None
    try:
        low = rms_norm(
            xd, None if w is None else w.to(DEV), 1e-6, torch.bfloat16, rope=(c.to(DEV), s.to(DEV))
        )
    finally:
        if shim:
            triton_bf16.uninstall()
    assert low.dtype == torch.bfloat16 and low.is_contiguous()
    assert torch.equal(low.cpu(), got.cpu().to(torch.bfloat16))


def test_rms_norm_rope_refuses_bad_tables():
    x = torch.randn(4, 128, device=DEV)
    c = torch.randn(4, 32, device=DEV)
    with pytest.raises(ValueError, match="one cos / sin row per token"):
        rms_norm(x, None, 1e-6, rope=(c[:2], c[:2]))
    with pytest.raises(ValueError, match="power of two"):
        rms_norm(x, None, 1e-6, rope=(c[:, :24].contiguous(), c[:, :24].contiguous()))
    with pytest.raises(ValueError, match="fp32"):
        rms_norm(x, None, 1e-6, rope=(c.double(), c.double()))
