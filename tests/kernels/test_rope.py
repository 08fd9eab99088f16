import pytest
import torch

from sglang_ernie55.kernels.rope import rope_
from sglang_ernie55.reference import rope
from tests.kernels.kutil import DEV, cos_sin


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_inplace(inverse):
    torch.manual_seed(0)
    inv, c, s = cos_sin(5000)
    x = torch.randn(5, 20, 512, device=DEV).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 127, 4999, 500], device=DEV)
    ref = x.float().cpu().clone()
    ref[..., -64:] = rope.apply_rope_interleaved(ref[..., -64:], pos.cpu(), inv, inverse=inverse)
    y = rope_(x.clone(), pos, c, s, inverse=inverse)
    assert (y.float().cpu() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(y[..., :448], x[..., :448])


@pytest.mark.parametrize("T", [0, 1, 3, 19, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_modes_of_the_layers(T, dtype):
    """The layers' forms: per-token cos / sin rows (positions=None), interleaved on the last dims (HCA q / kv,
    inverse on the output, MLA q_pe / k_pe) and rotate-half on the first dims (the indexer), in place; the
    rest of the row untouched."""
    g = torch.Generator().manual_seed(T)
    inv = rope.yarn_inv_freq(64, 160000.0, None)
    pos = torch.randint(0, 1 << 16, (T,), generator=g)
    c, s = rope.cos_sin(pos, inv)
    x = torch.randn(T, 16, 192, generator=g).to(dtype)
    for kw, sl, fn in (
        (dict(), slice(128, 192), lambda v: rope.apply_rope_interleaved(v, pos, inv)),
        (
            dict(inverse=True),
            slice(128, 192),
            lambda v: rope.apply_rope_interleaved(v, pos, inv, inverse=True),
        ),
        (dict(neox=True, start=0), slice(0, 64), lambda v: rope.apply_rope_half(v, pos, inv)),
    ):
        want = x.clone()
        want[..., sl] = fn(x[..., sl].float()).to(dtype)
        got = rope_(x.clone().to(DEV), None, c.to(DEV), s.to(DEV), **kw).cpu()
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        keep = torch.ones(192, dtype=torch.bool)
        keep[sl] = False
        assert torch.equal(got[..., keep], x[..., keep])
    # table rows indexed by positions == per-token rows
    tc, ts = rope.cos_sin(torch.arange(1 << 16), inv)
    a = rope_(x.clone().to(DEV), pos.to(DEV), tc.to(DEV), ts.to(DEV), neox=True, start=0)
    b = rope_(x.clone().to(DEV), None, c.to(DEV), s.to(DEV), neox=True, start=0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("heads", [1, 12, 20])
@pytest.mark.parametrize("T", [1, 19, 130])
def test_rope_odd_geometry(heads, T):
    """Issue 13's widths: RoPE 32 on the last dims of an HCA head of 96 (interleaved, and inverse) and on the
    first dims of an indexer head of 48 (rotate-half); head counts that are not a multiple of the kernel's
    16-head block (the last block masked); the rest of each row untouched."""
    g = torch.Generator().manual_seed(T * 100 + heads)
    inv = rope.yarn_inv_freq(32, 160000.0, None)
    pos = torch.randint(0, 1 << 16, (T,), generator=g)
    c, s = rope.cos_sin(pos, inv)
    for D, kw, sl, fn in (
        (96, dict(), slice(64, 96), lambda v: rope.apply_rope_interleaved(v, pos, inv)),
        (96, dict(inverse=True), slice(64, 96), lambda v: rope.apply_rope_interleaved(v, pos, inv, True)),
        (48, dict(neox=True, start=0), slice(0, 32), lambda v: rope.apply_rope_half(v, pos, inv)),
    ):
        x = torch.randn(T, heads, D, generator=g)
        want = x.clone()
        want[..., sl] = fn(x[..., sl])
        got = rope_(x.clone().to(DEV), None, c.to(DEV), s.to(DEV), **kw).cpu()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        keep = torch.ones(D, dtype=torch.bool)
        keep[sl] = False
        assert torch.equal(got[..., keep], x[..., keep])
