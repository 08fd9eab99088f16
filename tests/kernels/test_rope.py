import pytest
import torch
from kutil import DEV, cos_sin
from sglang_ernie55.kernels.rope import rope_

from sglang_ernie55.reference import rope


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
