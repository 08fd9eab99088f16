"""The target side of ECHO on CPU (docs/echo.md section 5): SGLang's TARGET_VERIFY through the `ernie55`
backend's torch twin, the model class's own forward and SGLang's LogitsProcessor on a real ForwardBatch
(tests/serving/twin_harness.py `Session.verify`), against the reference.

A verify runs S+1 rows per request (the bonus token and S drafts) at positions L..L+S with `seq_lens` = L
(the committed length), writes their KV at out_cache_loc and is causal among them; the worker then commits
the bonus and the accepted drafts, and the next verify starts at the first rejected position, rewriting the
same slots. The rounds below cross the compression blocks at 128 and 256 and the page at 256 with drafts
rejected on both sides of the boundary (including the row that completes a block), so the open-block
compression state must keep two blocks (the pool of a speculative server: `state_blocks=2`).
"""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import tiny_config  # noqa: E402
from sglang_ernie55.reference.model import build_reference  # noqa: E402
from tests.serving import twin_harness as th

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32 weights and activations, fp32 pool rows
# Per step count S: (prompt lengths of the two batched requests, accepted drafts per round per request).
ROUNDS = {
    3: ((125, 252), [(0, 1), (0, 0), (3, 0), (1, 3), (3, 2), (0, 1)]),
    1: ((126, 254), [(0, 0), (0, 1), (1, 0), (0, 1), (1, 1), (0, 0)]),
}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    ref = build_reference(cfg, seed=0, dtype=torch.float32)
    m = th.build_model(cfg, dtype=torch.float32)
    m.load_weights(ref.state_dict().items())
    th.torch_experts(m)
    return cfg, ref, m


def _tokens(cfg, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, cfg.vocab_size, (n,), generator=g)


def _prompts(cfg, lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = _tokens(cfg, n, g)
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


def _run_rounds(s, cfg, steps: int, seed: int, check=None, **verify_kw):
    """Prefill both prompts, then the verify rounds of ROUNDS[steps] (fresh random bonus/draft tokens each
    round). `check(r, committed, tokens, logits, streams)` sees every request's rows of every round."""
    lengths, rounds = ROUNDS[steps]
    committed = _prompts(cfg, lengths, seed)
    s.extend([0, 1], committed)
    g = torch.Generator().manual_seed(seed + 1)
    k = steps + 1
    for accepted in rounds:
        toks = [_tokens(cfg, k, g) for _ in committed]
        logits, streams = s.verify([0, 1], toks, **verify_kw)
        for r, a in enumerate(accepted):
            if check is not None:
                check(r, committed[r], toks[r], logits[r * k : (r + 1) * k], streams[r * k : (r + 1) * k])
            s.accept(r, a + 1)
            committed[r] = torch.cat([committed[r], toks[r][: a + 1]])
    return committed


@pytest.mark.slow
@pytest.mark.parametrize("steps,swa_pages", [(3, None), (1, None), (3, 4)], ids=["s3", "s1", "s3-swa"])
def test_verify_rows_equal_teacher_forced_reference(setup, steps, swa_pages):
    """Every verified row's logits equal the reference's full-sequence logits of (committed prefix + this
    round's tokens) at that position, and the hidden states the LogitsProcessor captures for the draft are
    the reference's pre-hc_head streams, round after round of rejections across blocks 128/256 and the
    page; a plain decode after the rounds is still exact (state ring and compressed entries consistent).
    `s3-swa`: window rows in the hybrid pool's SWA pool, slots from SGLang's SWATokenToKVPoolAllocator."""
    cfg, ref, m = setup
    s = th.Session(m, cfg, torch.float32, state_blocks=2, swa_pages=swa_pages)
    n, H = cfg.hc_mult, cfg.hidden_size
    seen = []

    def check(r, prefix, toks, logits, streams):
        want = ref.forward(torch.cat([prefix, toks]))
        L = prefix.shape[0]
        torch.testing.assert_close(logits, want.logits[L:], **TOL)
        torch.testing.assert_close(streams.float().view(-1, n, H), want.streams[L:], **TOL)
        seen.append(L)

    committed = _run_rounds(s, cfg, steps, seed=steps, check=check)
    assert len(seen) == 2 * len(ROUNDS[steps][1])
    assert min(seen) < 128 < max(c.shape[0] for c in committed)  # the rounds did cross the boundaries
    nxt = [int(c[-1]) for c in committed]  # any token: decode one more position for both requests
    got = s.decode([0, 1], nxt)
    for r, c in enumerate(committed):
        torch.testing.assert_close(
            got[r], ref.forward(torch.cat([c, torch.tensor([nxt[r]])])).logits[-1], **TOL
        )


@pytest.mark.slow
def test_verify_padded_graph_rows_match_eager(setup):
    """The CUDA-graph form (static-width metadata from init_forward_metadata_out_graph, the batch padded to
    4 requests as the decode graph runner pads it: req slot 0 (a live request here), out_cache_loc 0,
    seq_len 1) gives the eager logits, and padded rows write only the padding page and scratch rows."""
    cfg, _, m = setup
    eager = th.Session(m, cfg, torch.float32, state_blocks=2)
    graph = th.Session(m, cfg, torch.float32, state_blocks=2)
    out = {}

    def rec(name):
        def f(r, prefix, toks, logits, streams):
            out.setdefault(name, []).append(logits)

        return f

    _run_rounds(eager, cfg, 3, seed=7, check=rec("eager"))
    _run_rounds(graph, cfg, 3, seed=7, check=rec("graph"), pad_to=4, graph=True)
    torch.testing.assert_close(torch.cat(out["graph"]), torch.cat(out["eager"]), atol=2e-5, rtol=2e-5)
    pe, pg = eager.pool, graph.pool
    for lid in pe.state:
        sc = pe.state_scratch
        torch.testing.assert_close(
            pg.state[lid][:sc], pe.state[lid][:sc], atol=1e-4, rtol=1e-4
        )  # GEMM batch shapes differ
        torch.testing.assert_close(
            pg.cmp[lid].data[:-1], pe.cmp[lid].data[:-1], atol=1e-4, rtol=1e-4
        )  # GEMM batch shapes differ
        torch.testing.assert_close(
            pg.win[lid].data[256:], pe.win[lid].data[256:], atol=1e-4, rtol=1e-4
        )  # GEMM batch shapes differ
    for lid in pe.latent:
        torch.testing.assert_close(
            pg.latent[lid].data[256:], pe.latent[lid].data[256:], atol=1e-4, rtol=1e-4
        )  # GEMM batch shapes differ


@pytest.mark.slow
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_verify_on_quantized_pool_equals_sequential_decode(setup, kv):
    """bf16 / fp8 pools (the kernels' byte layouts): the verified rows that end up committed give the logits
    of decoding the committed sequence one token at a time over the same pool dtype (the same stored
    rows), whatever was rejected in between."""
    cfg, _, m = setup
    s = th.Session(m, cfg, kv, state_blocks=2)
    rows = []

    def keep(r, prefix, toks, logits, streams):
        rows.append((r, prefix.shape[0], logits))

    lengths, rounds = ROUNDS[3]
    committed = _run_rounds(s, cfg, 3, seed=11, check=keep)
    seq = th.Session(m, cfg, kv)
    seq.extend([0, 1], [c[:n] for c, n in zip(committed, lengths)])
    dec = {0: {}, 1: {}}
    for t in range(max(c.shape[0] - n for c, n in zip(committed, lengths))):
        live = [r for r in (0, 1) if lengths[r] + t < committed[r].shape[0]]
        got = seq.decode(live, [int(committed[r][lengths[r] + t]) for r in live])
        for i, r in enumerate(live):
            dec[r][lengths[r] + t] = got[i]
    checked = 0
    for (r, L, logits), accepted in zip(rows, [a for rnd in rounds for a in rnd]):
        for i in range(accepted + 1):  # the committed rows of this round (bonus + accepted drafts)
            if L + i in dec[r]:
                want = dec[r][L + i]
                cos = torch.nn.functional.cosine_similarity(logits[i], want, dim=0)
                assert cos > 0.99999 and int(logits[i].argmax()) == int(want.argmax()), (r, L + i, float(cos))
                checked += 1
    assert checked >= 20


def test_verify_needs_the_two_block_state(setup):
    """A pool built without the speculative state ring refuses TARGET_VERIFY with an error naming why."""
    cfg, _, m = setup
    s = th.Session(m, cfg, torch.float32)
    s.extend([0], _prompts(cfg, [40], 3))
    with pytest.raises(RuntimeError, match="two-block open-block compression state"):
        s.verify([0], [torch.tensor([5, 6, 7])])
