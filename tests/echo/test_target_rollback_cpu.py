"""What ECHO needs from the target's `ernie55` backend when drafts are rejected (docs/echo.md section 5.4),
on the target's CPU twin (tests/serving/twin_harness.py), simulating SGLang's verify as an extend.

A verify extends S+1 positions L..L+S; a rejection at L+a rolls the request back to L+a+1 and the next
verify rewrites the same slots. The target must then give the reference's logits of the committed
sequence. Inside one 128-token block (control) and across a block boundary, where the next block's first
rows land in the other half of the two-block open-block state ring (`pos % (2 * ratio)`, the pool of a
speculative server) instead of over the rows of the block the rejected tokens would have completed. (This
was a strict xfail with the one-block state; tests/echo/test_target_verify_cpu.py runs the same through
the backend's TARGET_VERIFY mode.)
"""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import tiny_config  # noqa: E402
from sglang_ernie55.reference.model import build_reference  # noqa: E402
from tests.serving import twin_harness as th


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    ref = build_reference(cfg, seed=0, dtype=torch.float32)
    m = th.build_model(cfg, dtype=torch.float32)
    m.load_weights(ref.state_dict().items())
    th.torch_experts(m)
    return cfg, ref, m


def _verify_reject_verify(cfg, ref, m, L: int):
    """Prompt of L tokens; verify 4 tokens at L..L+3, accept only the first; verify 4 others at L+1..L+4.
    Returns (twin logits of the second verify, reference logits of those positions)."""
    g = torch.Generator().manual_seed(L)
    ids = torch.randint(3, cfg.vocab_size, (L + 8,), generator=g)
    ids[0] = cfg.bos_token_id
    s = th.Session(m, cfg, torch.float32, state_blocks=2)  # as a speculative server builds the pool
    s.extend([0], [ids[:L]])
    s.extend([0], [ids[L : L + 4]])  # verify 1: bonus + 3 drafts
    s.lens[0] = L + 1  # accepted: the bonus only; positions L+1.. are rewritten next
    second = ids[L + 4 : L + 8]
    got = s.extend([0], [second])  # verify 2 at L+1 .. L+4
    seq = torch.cat([ids[: L + 1], second])
    return got, ref.forward(seq).logits[L + 1 :]


def test_rejected_drafts_inside_a_block(setup):
    cfg, ref, m = setup
    got, want = _verify_reject_verify(cfg, ref, m, 60)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rejected_drafts_across_a_block_boundary(setup):
    cfg, ref, m = setup
    got, want = _verify_reject_verify(cfg, ref, m, 125)  # verify 1 writes 125..128: block 1's first row
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
