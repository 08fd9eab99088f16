"""The ECHO draft's window attention over a prefill chunk of SGLang's default size at the full-width geometry
on the GPU: its transient memory stays near one row slice (`torch_path.CHUNK_BYTES`), not the several GB that
the whole chunk's gathered windows and softmax terms take (more than SGLang's default memory fraction leaves
beside the pool), and the sliced rows equal the rows computed in one piece."""

from __future__ import annotations

import pytest
import torch

from tests.echo.test_draft_cpu import window_attention_full_width

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("kind", ["hca", "mla_dsa"])
def test_draft_window_prefill_memory_bounded(kind):
    from sglang_ernie55.attention import torch_path

    T = 8192
    out, whole, peak, step = window_attention_full_width("cuda", T, kind)
    torch.testing.assert_close(out[: whole.shape[0]], whole, rtol=1e-5, atol=1e-5)
    # the output itself plus one slice's transients (with the allocator's rounding)
    assert peak <= out.numel() * 4 + 1.25 * torch_path.CHUNK_BYTES, (peak, step)
