"""CPU tests of the SGLang ECHO draft (`Ernie5_5MoeMTPModel`): strict `echo.*` weight mapping, sharing of
the target's modules (data pointers), and the draft model + ECHO backend + draft pool against the
reference's `echo_forward` / chained rounds, through the same world-1 harness as the target model
(tests/serving/twin_harness.py)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from sglang_ernie55.configuration import ARCH_ECHO, SERVING_PAGE_SIZE, tiny_config  # noqa: E402
from sglang_ernie55.reference import echo as refecho  # noqa: E402
from tests.serving import twin_harness as th

PAGE = SERVING_PAGE_SIZE


def _cfg(last: str):
    return tiny_config(layer_types=["hca", "mla_dsa", "hca", last])


@pytest.fixture(scope="module", params=["hca", "mla_dsa"])
def setup(request):
    """(cfg, reference fp32, target fp32, draft attached) for a last layer of each kind."""
    cfg = _cfg(request.param)
    ref, target, draft = th.build_echo_pair(cfg, seed=1)
    return cfg, ref, target, draft


class DraftSession:
    """Draft pool + ECHO backend over a paged slot space (slot 0..255 = padding page)."""

    def __init__(
        self,
        draft,
        cfg,
        kv_dtype=torch.float32,
        max_ctx=1024,
        slots=4,
        swa: bool = False,
        device: str = "cpu",
    ):
        from sglang_ernie55.attention.draft_backend import EchoDraftAttnBackend
        from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

        self.draft, self.cfg, self.device = draft, cfg, device
        pages = max_ctx // PAGE  # every request owns contiguous pages (allocation is not under test)
        size = slots * pages * PAGE
        # swa: an SWA pool of 2 pages per request (positions < 512), full page (1 + r * pages + k) -> SWA page
        # 2 * slots - 2 * r - k (reverse order), as SGLang's allocator would register it
        swa_pages = 2 * slots if swa else None
        self.pool = EchoDraftKVPool(
            size, PAGE, kv_dtype, cfg, device=device, swa_size=swa_pages * PAGE if swa else None
        )
        self.req_to_token = torch.zeros(slots, max_ctx, dtype=torch.int32)
        mapping = torch.zeros(size + PAGE + 1, dtype=torch.int64)
        mapping[-1] = -1
        for r in range(slots):
            base = (1 + r * pages) * PAGE
            self.req_to_token[r] = torch.arange(base, base + max_ctx)
            for k in range(2):
                full = torch.arange(base + k * PAGE, base + (k + 1) * PAGE)
                mapping[full] = (2 * slots - 2 * r - k) * PAGE + full % PAGE
        self.req_to_token = self.req_to_token.to(device)
        if swa:
            self.pool.register_mapping(mapping.to(device))
        runner = SimpleNamespace(
            token_to_kv_pool=self.pool,
            model_config=SimpleNamespace(hf_config=cfg),
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
        )
        self.backend = EchoDraftAttnBackend(runner)

    def extend_prompts(self, lens: dict[int, int], seed: int):
        """One prefill draft-extend (EXTEND, ragged) of a random prompt per request slot (`lens`: slot -> tokens):
        ({slot: (streams, tokens)}, logits, draft streams) with the rows request after request."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        cfg, g = self.cfg, torch.Generator().manual_seed(seed)
        data = {
            r: (
                torch.randn(n, cfg.hc_mult, cfg.hidden_size, generator=g),
                torch.randint(0, cfg.vocab_size, (n,), generator=g),
            )
            for r, n in lens.items()
        }
        reqs = [r for r, n in lens.items() for _ in range(n)]
        pos = [p for n in lens.values() for p in range(n)]
        toks = torch.cat([data[r][1] for r in lens])
        streams = torch.cat([data[r][0] for r in lens])
        logits, R = self.run(ForwardMode.EXTEND, reqs, pos, toks, streams, ragged=list(lens.values()))
        return data, logits, R

    def run(self, mode, reqs, positions, tokens, streams, ragged=None):
        """One draft forward: rows (reqs[i], positions[i], tokens[i], streams[i]) -> fp32 logits, draft streams."""
        from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

        d = self.device
        reqs_t, pos = torch.as_tensor(reqs, device=d), torch.as_tensor(positions, device=d)
        loc = self.req_to_token[reqs_t, pos].long()
        uniq = list(dict.fromkeys(reqs))
        fb = SimpleNamespace(
            forward_mode=mode,
            out_cache_loc=loc,
            req_pool_indices=torch.tensor(uniq, device=d),
            positions=pos,
            extend_seq_lens_cpu=ragged,
            seq_lens=None,
            seq_lens_cpu=None,
            global_num_token_non_padded_cpu=None,
            batch_size=len(uniq),
            spec_info=SimpleNamespace(hidden_states=streams.flatten(1).to(d)),
        )
        self.backend.init_forward_metadata(fb)
        prev = set_forward_context(ForwardContext(attn_backend=self.backend))
        try:
            hidden, R = self.draft.hidden(torch.as_tensor(tokens, device=d), pos, fb)
        finally:
            set_forward_context(prev)
        return hidden.float() @ self.draft.lm_head.weight.float().t(), R


def test_entry_class_and_strict_echo_weights(setup):
    from sglang_ernie55.models import ernie55_echo
    from sglang_ernie55.models.ernie55_echo import Ernie55EchoWeightError

    cfg, ref, _, draft = setup
    assert [c.__name__ for c in ernie55_echo.EntryClass] == [ARCH_ECHO]
    sd = ref.state_dict()
    own = dict(draft.named_parameters())
    # the draft owns exactly the checkpoint's echo.* tensors, under the same names
    assert set(own) == {n for n in sd if n.startswith("echo.")}
    for n, p in own.items():
        torch.testing.assert_close(p, sd[n])
    # a missing echo tensor, an unknown tensor, a duplicate: all named
    items = [(n, t) for n, t in sd.items() if n != "echo.h_proj.weight"] + [
        ("echo.bogus.weight", torch.ones(1))
    ]
    with pytest.raises(
        Ernie55EchoWeightError, match=r"echo\.bogus\.weight[\s\S]*echo\.h_proj\.weight loaded 0"
    ):
        draft.load_weights(items)
    with pytest.raises(Ernie55EchoWeightError, match=r"echo\.norm\.weight loaded 2"):
        draft.load_weights(list(sd.items()) + [("echo.norm.weight", sd["echo.norm.weight"])])
    draft.load_weights(sd.items())


def test_fp8_echo_weights_dequantized_on_load(setup):
    from sglang_ernie55.checkpoint.fp8 import dequantize_fp8_block, quantize_fp8_block

    cfg, ref, _, draft = setup
    sd = dict(ref.state_dict())
    q, s = quantize_fp8_block(sd["echo.e_proj.weight"])
    sd["echo.e_proj.weight"], sd["echo.e_proj.weight_scale_inv"] = q, s
    draft.load_weights(sd.items())
    try:
        torch.testing.assert_close(draft.echo.e_proj.weight, dequantize_fp8_block(q, s, torch.float32))
        assert not torch.equal(
            draft.echo.e_proj.weight, ref.state_dict()["echo.e_proj.weight"]
        )  # it was quantized
    finally:
        draft.load_weights(ref.state_dict().items())


def test_draft_shares_the_targets_tensors(setup):
    """Last layer, hc_head, embedding and lm_head: the target's parameters themselves (data pointers),
    and the draft's own state holds only the five echo tensors (no second copy of the layer)."""
    from sglang_ernie55.speculative import check_shared

    cfg, _, target, draft = setup
    ptrs = check_shared(draft, target)
    L = cfg.num_hidden_layers - 1
    tp = dict(target.named_parameters())
    assert ptrs["model.hc_head.fn"] == tp["model.hc_head.fn"].data_ptr()
    assert ptrs[f"model.layers.{L}.attn_hc.fn"] == tp[f"model.layers.{L}.attn_hc.fn"].data_ptr()
    assert draft.decoder_layer is target.model.layers[-1]
    n_own = sum(p.numel() for p in draft.parameters())
    H = cfg.hidden_size
    assert n_own == 2 * H * H + 3 * H == cfg.parameter_counts()["echo"]


def test_unattached_draft_refuses_to_run():
    from sglang_ernie55.models.ernie55_echo import Ernie5_5MoeMTPModel

    th.init_dist()
    d = Ernie5_5MoeMTPModel(tiny_config())
    with pytest.raises(RuntimeError, match="not attached"):
        d.get_embed_and_head()


@pytest.mark.parametrize("swa", [False, True])
def test_draft_extend_and_chain_equal_reference(setup, swa):
    """Draft-extend over a 140-entry prompt (EXTEND, ragged rows of two requests: one crosses the 128-token
    window), then two chained decode steps per request fed back the draft's own streams: logits equal
    the reference's `draft_round` at every proposing entry, and the extend's every row equals
    `echo_forward`. With `swa` the rows sit at SWA slots that differ from the full slots (a permuted,
    smaller SWA pool), as under SGLang's hybrid allocator."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, ref, _, draft = setup
    sess = DraftSession(draft, cfg, swa=swa)
    lens = {0: 140, 2: 37}
    data, logits, R = sess.extend_prompts(lens, seed=0)
    off, last = 0, {}
    for r, n in lens.items():
        want = ref.echo_forward(*data[r])
        torch.testing.assert_close(logits[off : off + n], want.logits, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(R[off : off + n], want.streams, rtol=2e-4, atol=2e-4)
        last[r] = (logits[off + n - 1], R[off + n - 1], n - 1)
        off += n
    rounds = {r: refecho.draft_round(ref, ref.new_echo_cache(), *data[r], 0, 3) for r in lens}
    for k in range(1, 3):  # chained decode steps, both requests in one batch
        reqs_k = list(lens)
        toks_k = torch.tensor([int(torch.argmax(last[r][0])) for r in reqs_k])
        pos_k = [last[r][2] + 1 for r in reqs_k]
        st_k = torch.stack([last[r][1] for r in reqs_k])
        lg, Rk = sess.run(ForwardMode.DECODE, reqs_k, pos_k, toks_k, st_k)
        for i, r in enumerate(reqs_k):
            assert int(toks_k[i]) == rounds[r].tokens[k - 1]
            torch.testing.assert_close(lg[i], rounds[r].logits[k], rtol=2e-4, atol=2e-4)
            last[r] = (lg[i], Rk[i], pos_k[i])


def test_draft_extend_v2_uniform_rows_overwrite_rejected_positions(setup):
    """DRAFT_EXTEND_V2 (k rows per request, no extend lengths): a second extend over the same positions
    with different tokens (the rejected drafts' rows rewritten) gives the reference's logits for the new
    entries; positions 125..130 straddle the window edge."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, ref, _, draft = setup
    sess = DraftSession(draft, cfg)
    g = torch.Generator().manual_seed(5)
    n0, k = 125, 3
    S = torch.randn(n0 + 2 * k, cfg.hc_mult, cfg.hidden_size, generator=g)
    T = torch.randint(0, cfg.vocab_size, (n0 + 2 * k,), generator=g)
    sess.run(ForwardMode.EXTEND, [1] * n0, list(range(n0)), T[:n0], S[:n0], ragged=[n0])
    junk = torch.randint(0, cfg.vocab_size, (k,), generator=g)  # a round whose drafts were all rejected
    sess.run(ForwardMode.DRAFT_EXTEND_V2, [1] * k, list(range(n0, n0 + k)), junk, S[n0 : n0 + k] * 0.5)
    lg, _ = sess.run(
        ForwardMode.DRAFT_EXTEND_V2, [1] * k, list(range(n0, n0 + k)), T[n0 : n0 + k], S[n0 : n0 + k]
    )
    want = ref.echo_forward(S[: n0 + k], T[: n0 + k]).logits[n0:]
    torch.testing.assert_close(lg, want, rtol=2e-4, atol=2e-4)
    lg2, _ = sess.run(
        ForwardMode.DRAFT_EXTEND_V2, [1] * k, list(range(n0 + k, n0 + 2 * k)), T[n0 + k :], S[n0 + k :]
    )
    torch.testing.assert_close(lg2, ref.echo_forward(S, T).logits[n0 + k :], rtol=2e-4, atol=2e-4)


@contextlib.contextmanager
def pool_rounded_reference(cfg, kv_dtype):
    """The reference with the tensors the draft pool stores (HCA kv; MLA latent | k_pe) passed through the
    pool's own byte codec: the oracle for bf16 / fp8 draft KV (queries and everything else fp32)."""
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool
    from sglang_ernie55.reference import model as M

    scratch = EchoDraftKVPool(PAGE, PAGE, kv_dtype, cfg, device="cpu")

    def rnd(x):
        out = []
        for i in range(0, x.shape[0], PAGE):
            loc = torch.arange(PAGE, PAGE + x[i : i + PAGE].shape[0])
            scratch.rows.write(loc, x[i : i + PAGE])
            out.append(scratch.rows.read(loc))
        return torch.cat(out)

    hca_p, mla_p = M.HCAAttention.project, M.MLADSAAttention.project
    R = cfg.kv_lora_rank

    def hca(self, x, pos):
        q, kv, c, sc = hca_p(self, x, pos)
        return q, rnd(kv), c, sc

    def mla(self, x, pos):
        q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx = mla_p(self, x, pos)
        lk = rnd(torch.cat([latent, k_pe], -1))
        return q_nope, q_pe, lk[:, :R], lk[:, R:], q_idx, k_idx, w_idx

    M.HCAAttention.project, M.MLADSAAttention.project = hca, mla
    try:
        yield
    finally:
        M.HCAAttention.project, M.MLADSAAttention.project = hca_p, mla_p


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_draft_pool_dtypes_equal_rounded_reference(setup, kv):
    """bf16 / fp8 draft KV rows (the target's byte layouts): the extend equals the reference whose stored
    tensors go through the same codec; and differs from the unrounded one (quantisation is really on)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, ref, _, draft = setup
    dt = torch.bfloat16 if kv == "bfloat16" else torch.float8_e4m3fn
    sess = DraftSession(draft, cfg, kv_dtype=dt)
    assert sess.pool.fp8 == (kv == "fp8_e4m3") and sess.pool.rows.buffers()[0].dtype == torch.uint8
    g = torch.Generator().manual_seed(9)
    S = torch.randn(150, cfg.hc_mult, cfg.hidden_size, generator=g)
    T = torch.randint(0, cfg.vocab_size, (150,), generator=g)
    lg, _ = sess.run(ForwardMode.EXTEND, [0] * 150, list(range(150)), T, S, ragged=[150])
    with pool_rounded_reference(cfg, dt):
        want = ref.echo_forward(S, T).logits
    torch.testing.assert_close(lg, want, rtol=2e-4, atol=2e-4)
    assert (lg - ref.echo_forward(S, T).logits).abs().max() > 1e-3


def test_echo_bytes_per_token(setup):
    """The pool allocates what `echo_bytes_per_token` (the configurator's reservation) says; full size HCA
    fp8 is SGLang's V4 window layout (584 B/token, 585 with its page padding)."""
    from sglang_ernie55.configuration import Ernie55Config
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool, echo_bytes_per_token

    cfg = setup[0]
    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        pool = EchoDraftKVPool(4 * PAGE, PAGE, dt, cfg, device="cpu")
        assert pool.get_kv_size_bytes() == pool.token_rows * echo_bytes_per_token(cfg, dt)
    full = Ernie55Config()
    assert echo_bytes_per_token(full, torch.float8_e4m3fn) == 149_760 / 256
    assert echo_bytes_per_token(full, torch.bfloat16) == 1024


@pytest.mark.parametrize("swa", [False, True])
def test_chunked_draft_extend_equals_whole(setup, swa):
    """Chunked prefill: the draft-extend of a 300-entry prompt in chunks 0..99 | 100..299 (with a second
    request's rows in the first batch) gives the reference's whole-sequence logits (also over SWA slots)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, ref, _, draft = setup
    sess = DraftSession(draft, cfg, swa=swa)
    g = torch.Generator().manual_seed(13)
    S = torch.randn(300, cfg.hc_mult, cfg.hidden_size, generator=g)
    T = torch.randint(0, cfg.vocab_size, (300,), generator=g)
    S2 = torch.randn(7, cfg.hc_mult, cfg.hidden_size, generator=g)
    T2 = torch.randint(0, cfg.vocab_size, (7,), generator=g)
    first, _ = sess.run(
        ForwardMode.EXTEND,
        [3] * 7 + [0] * 100,
        list(range(7)) + list(range(100)),
        torch.cat([T2, T[:100]]),
        torch.cat([S2, S[:100]]),
        ragged=[7, 100],
    )
    second, _ = sess.run(ForwardMode.EXTEND, [0] * 200, list(range(100, 300)), T[100:], S[100:], ragged=[200])
    want = ref.echo_forward(S, T).logits
    torch.testing.assert_close(torch.cat([first[7:], second]), want, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(first[:7], ref.echo_forward(S2, T2).logits, rtol=2e-4, atol=2e-4)


def test_long_draft_extend_in_row_slices_equals_reference(setup, monkeypatch):
    """A draft-extend longer than one row slice of the window attention (slices shrunk to 16 rows here; a
    prefill chunk of SGLang's default size takes several slices at full width) runs in slices and still gives
    the reference's `echo_forward` logits and streams for every row of both ragged requests."""

    from sglang_ernie55.attention import draft_backend

    cfg, ref, _, draft = setup
    sess = DraftSession(draft, cfg)
    calls = []
    real = draft_backend.EchoDraftAttnBackend._window_rows

    def counted(self, q, *a, **k):
        calls.append(q.shape[0])
        return real(self, q, *a, **k)

    monkeypatch.setattr(draft_backend.EchoDraftAttnBackend, "_window_rows", counted)
    monkeypatch.setattr(draft_backend, "window_row_chunk", lambda *a: 16)
    lens = {1: 150, 3: 41}
    data, logits, R = sess.extend_prompts(lens, seed=21)
    assert calls == [16] * (191 // 16) + [191 % 16]
    off = 0
    for r, n in lens.items():
        want = ref.echo_forward(*data[r])
        torch.testing.assert_close(logits[off : off + n], want.logits, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(R[off : off + n], want.streams, rtol=2e-4, atol=2e-4)
        off += n


def window_attention_full_width(device: str, T: int, kind: str):
    """The draft backend's window attention at the full-width geometry (fp8 rows, window 128) over T prompt rows
    of one request: (sliced output, the same rows unsliced (first 256 rows), peak bytes of the sliced call above
    its inputs on CUDA, else None, the slice size)."""
    from sglang_ernie55.attention import draft_backend
    from sglang_ernie55.configuration import Ernie55Config
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

    cfg = Ernie55Config(num_hidden_layers=2, layer_types=["hca", kind])
    ctx = -(-T // PAGE) * PAGE
    pool = EchoDraftKVPool(ctx + PAGE, PAGE, torch.float8_e4m3fn, cfg, device=device)
    req_to_token = torch.arange(PAGE, PAGE + ctx, dtype=torch.int32, device=device)[None]
    runner = SimpleNamespace(
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(hf_config=cfg),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
    )
    backend = draft_backend.EchoDraftAttnBackend(runner)
    g = torch.Generator(device=device).manual_seed(5)
    if kind == "hca":
        h, c, dv = cfg.num_attention_heads, cfg.head_dim, cfg.head_dim
    else:
        h, c, dv = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    layer = SimpleNamespace(layer_id=pool.layer_id, scaling=c**-0.5, v_head_dim=dv)
    inputs = SimpleNamespace(sink=torch.randn(h, generator=g, device=device) if kind == "hca" else None)
    q = torch.randn(T, h, c, generator=g, device=device, dtype=torch.bfloat16)
    k = torch.randn(T, 1, c, generator=g, device=device, dtype=torch.bfloat16)
    pos = torch.arange(T, device=device)
    fb = SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False),
        extend_seq_lens_cpu=[T],
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
        positions=pos,
        out_cache_loc=req_to_token[0, :T].long(),
    )
    backend.init_forward_metadata(fb)
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = backend._window_attention(q, k, layer, fb, inputs)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    n = min(T, 256)
    whole = backend._window_rows(q[:n], backend._rows(T, fb)[:n], pos[:n], pool.rows, layer, inputs)
    step = draft_backend.window_row_chunk(cfg.window_size, h, c, dv, draft_backend.read_cost(pool.rows))
    return out, whole, peak, step


@pytest.mark.parametrize("kind", ["hca", "mla_dsa"])
def test_full_width_draft_window_in_slices_equals_whole(kind):
    """At the full-width geometry the window attention of a 600-row prompt runs in several row slices, and its
    first rows equal the same rows computed in one piece (the rows are independent)."""
    out, whole, _, step = window_attention_full_width("cpu", 600, kind)
    assert step < 600
    torch.testing.assert_close(out[: whole.shape[0]], whole, rtol=1e-6, atol=1e-6)
