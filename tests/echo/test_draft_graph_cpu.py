"""The ECHO draft extend under SGLang's `EAGLEDraftExtendCudaGraphRunner`, on CPU.

A CUDA graph cannot be captured here, so the test runs SGLang's own runner code (`__init__`'s static buffers,
`capture_one_shape`'s capture-time ForwardBatch and backend calls, `execute`'s buffer filling, request padding
and `init_forward_metadata_out_graph(view)`) with the graph backend emulated:

- "capture" runs the runner's `run_once` (warm-up, then the recorded run) and keeps it; "replay" runs the kept
  `run_once` again: the capture-time ForwardBatch over the static buffers, as a graph replays the recorded
  kernels on the captured addresses;
- the attention backend's Python state is frozen at capture and put back for every replay (a graph cannot see
  what `init_forward_metadata_out_graph(view)` assigns at replay unless it is written into captured memory);
- captured and replayed forwards run under a tripwire that fails on any host read of device data (`.item()`,
  `bool(t)`, `int(t)`, `.tolist()`, data-dependent shapes: nonzero, unique, masked_select, repeat_interleave by
  a tensor without output_size): what a CUDA graph cannot record.

Against that, per speculative step count S (S+1 rows per request) and batches of 1 and 3 requests padded to
the captured 4 (and 4 unpadded), over pools with and without SWA slots: the graph form's logits / draft streams
at the selected rows and every pool row equal the eager DRAFT_EXTEND_V2 forward's on the same inputs, with
verify windows across positions 128 (window, compression block) and 256 (page); capture and padded rows
write nothing but the padding page. The draft's experts run as twin_harness.static_experts, a static-shape stand-in (the FusedMoE
Triton kernel the GPU records needs a GPU; twin_harness.torch_experts loops over `.unique().tolist()`).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.echo.test_draft_cpu import PAGE, DraftSession, _cfg
from tests.serving import twin_harness as th

CAPTURE_BS = [4]
# request slot -> its committed length L before the round (the verify window is L .. L+S): windows across
# 256 (page, second compression block), across 128 (window, first block), short, past 300
HISTORY = {1: 255, 2: 127, 3: 40, 4: 300}


# ------------------------------------------------------------------ what a CUDA graph cannot record
class HostSyncError(AssertionError):
    pass


_FORBIDDEN = {
    "aten._local_scalar_dense": "a host read of a device value (.item(), bool(t), int(t), float(t), t as index)",
    "aten.nonzero": "nonzero (data-dependent shape)",
    "aten.masked_select": "masked_select (data-dependent shape)",
    "aten._unique2": "unique (data-dependent shape)",
    "aten.unique_consecutive": "unique_consecutive (data-dependent shape)",
    "aten.unique_dim": "unique (data-dependent shape)",
}


class GraphTripwire(TorchDispatchMode):
    """Fails on ops a CUDA graph cannot record; counts the ops it sees (`ops`)."""

    def __init__(self):
        super().__init__()
        self.ops = 0  # every aten op
        self.kernels = 0  # aten ops that are not views (each one launch on a GPU in eager mode)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        why = _FORBIDDEN.get(name)
        if (
            name == "aten.repeat_interleave"
            and isinstance(args[0], torch.Tensor)
            and kwargs.get("output_size") is None
        ):
            if len(args) == 1 or isinstance(args[1], torch.Tensor):
                why = "repeat_interleave by a tensor without output_size (host sync)"
        if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            idx = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                why = "boolean-mask indexing (data-dependent shape)"
        if why:
            raise HostSyncError(f"{func}: {why}")
        self.ops += 1
        self.kernels += not func.is_view
        return func(*args, **kwargs)


@contextlib.contextmanager
def graph_tripwire():
    """The dispatcher tripwire plus the host reads that bypass the dispatcher on CPU tensors."""

    def refuse(what):
        def f(self, *a, **k):
            raise HostSyncError(f"Tensor.{what}() in a captured forward (host read)")

        return f

    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy")}
    for n in saved:
        setattr(torch.Tensor, n, refuse(n))
    mode = GraphTripwire()
    try:
        with mode:
            yield mode
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class EmulatedGraphs:
    """CPU stand-in for the runner's graph backend (`capture_one` / `replay`), see the module docstring."""

    def __init__(self, attn_backend):
        self.attn_backend = attn_backend
        self.graphs: dict = {}
        self.replays = 0

    def capture_one(self, shape_key, run_once, capture_inputs=None, post_warmup_hook=None):
        run_once()  # warm-up, eager (SGLang's full-graph backend warms up before capturing)
        if post_warmup_hook is not None:
            post_warmup_hook()
        from sglang.srt.model_executor.forward_context import get_forward_context

        frozen = dict(vars(self.attn_backend))
        with graph_tripwire():
            run_once()  # the recorded forward
        self.graphs[shape_key] = (run_once, frozen, get_forward_context())

    def replay(self, shape_key, forward_batch):
        from sglang.srt.model_executor.forward_context import set_forward_context

        run_once, frozen, ctx = self.graphs[shape_key]
        now = dict(vars(self.attn_backend))
        vars(self.attn_backend).update(frozen)
        prev = set_forward_context(ctx)  # the recorded kernels ran under the capture's context
        try:
            with graph_tripwire() as mode:
                out = run_once()
            self.last_kernels = mode.kernels
        finally:
            set_forward_context(prev)
            vars(self.attn_backend).clear()
            vars(self.attn_backend).update(now)
        self.replays += 1
        return out


# ------------------------------------------------------------------ the draft, its pool and SGLang's runner
def make_draft(kind: str, device: str = "cpu"):
    """(cfg, draft attached to its target), fp32, dense static-shape experts, on `device`."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    cfg = _cfg(kind)
    _, _, draft = th.build_echo_pair(cfg, seed=3, experts=th.static_experts, device=device)
    draft.shared_experts_config = SharedExpertsConfig()  # SGLang's loader sets it on every model
    return cfg, draft


@pytest.fixture(scope="module", params=["hca", "mla_dsa"])
def draft_setup(request):
    return make_draft(request.param)


def build_runner(monkeypatch, sess, draft, cfg, steps: int, graphs_cls=EmulatedGraphs):
    """SGLang's `EAGLEDraftExtendCudaGraphRunner.__init__` without a server: its server-context reads answered,
    the graph backend `graphs_cls` (emulated on CPU), `capture()` = `capture_one_shape` per captured batch size
    (largest first, as SGLang)."""
    from sglang.srt.speculative import eagle_draft_extend_cuda_graph_runner as edr
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    width = steps + 1
    ns = SimpleNamespace
    for name, value in {
        "deployment_attn_dp_size": lambda: 1,
        "get_parallel": lambda: ns(pp_size=1),
        "get_flags": lambda: ns(capture=ns(enable_torch_compile=False)),
        "get_exec": lambda: ns(
            graph=ns(disable_cuda_graph_padding=False, enable_profile_cuda_graph=False),
            mamba=ns(enable_mamba_extra_buffer=False),
        ),
        "require_gathered_buffer": lambda: False,
        "require_mlp_tp_gather": lambda: False,
        "require_mlp_sync": lambda: False,
        "require_attn_tp_gather": lambda: False,
        "get_spec": lambda: ns(speculative_num_steps=steps),
        "get_batch_sizes_to_capture": lambda runner, *a, **k: (list(CAPTURE_BS), []),
        "resolve_num_tokens_per_req": lambda *, phase, **k: width if phase == "draft_extend" else 1,
        "get_draft_input_from_target_hidden_dim": lambda runner: cfg.hc_mult * cfg.hidden_size,
        "resolve_decode_backend": lambda runner: graphs_cls(runner.draft_extend_attn_backend),
        "model_capture_mode": contextlib.nullcontext,
        "maybe_flashinfer_autotune_speculative_draft": lambda *a, **k: None,
    }.items():
        monkeypatch.setattr(edr, name, value)

    def capture(self):
        self.buffers.reset_index_buffers()  # what DecodeCudaGraphRunner._capture does before capturing
        for bs in reversed(self.capture_bs):
            self.capture_one_shape(bs, forward=None)

    monkeypatch.setattr(edr.EAGLEDraftExtendCudaGraphRunner, "capture", capture)
    d = sess.device
    model_runner = ns(
        device=d,
        gpu_id=0,
        model=draft,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        is_draft_worker=True,
        model_config=ns(dtype=torch.float32, vocab_size=cfg.vocab_size, hf_config=cfg, model_is_mrope=False),
        graph_shared_output=ns(get_logits_buffer=lambda vocab, rows: torch.zeros(rows, vocab, device=d)),
        kv_index_translator=ns(bind_runner_slots=lambda fb: None),
        canary_manager=None,
        device_timer=None,
        shared_read_done_event=None,
    )
    worker = ns(
        draft_runner=model_runner,
        draft_extend_attn_backend=sess.backend,
        hot_token_id=None,
        speculative_algorithm=SpeculativeAlgorithm.EAGLE,
        seed_dsa_topk_from_draft_extend=False,
    )
    runner = edr.EAGLEDraftExtendCudaGraphRunner(worker)
    runner.model_context = contextlib.nullcontext  # get_model().override(...) needs a server context
    return runner


def session(draft, cfg, swa: bool, device: str = "cpu") -> DraftSession:
    """Request slots 1..4 live; slot 0 is SGLang's reserved all-zero `req_to_token` row (padded requests)."""
    sess = DraftSession(draft, cfg, slots=5, swa=swa, device=device)
    sess.req_to_token[0] = 0
    return sess


def pool_rows(sess) -> torch.Tensor:
    (buf,) = sess.pool.rows.buffers()
    return buf


def data_for(cfg, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, cfg.hc_mult, cfg.hidden_size, generator=g),
        torch.randint(0, cfg.vocab_size, (n,), generator=g),
    )


def round_batch(cfg, reqs, steps: int, seed: int, accept, device: str = "cpu"):
    """One DRAFT_EXTEND_V2 batch as SGLang's worker hands it over: S+1 rows per request at L..L+S."""
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    width = steps + 1
    streams, tokens = (x.to(device) for x in data_for(cfg, width * len(reqs), seed))
    positions = torch.tensor([HISTORY[r] + j for r in reqs for j in range(width)], device=device)
    acc = torch.tensor(accept, dtype=torch.int32, device=device)
    return dict(
        reqs=[r for r in reqs for _ in range(width)],
        positions=positions,
        tokens=tokens,
        streams=streams,
        accept=acc,
        select_index=torch.arange(len(reqs), device=device) * width + acc.long() - 1,
        spec=lambda: EagleDraftExtendInput(
            hidden_states=streams.flatten(1),
            num_correct_drafts=acc - 1,
            num_accept_tokens=acc,
            num_tokens_per_req=width,
            num_tokens_for_logprob_per_req=width,
        ),
    )


def forward_batch_for(sess, b, reqs):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    d = sess.device
    width = b["positions"].shape[0] // len(reqs)
    return SimpleNamespace(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        batch_size=len(reqs),
        input_ids=b["tokens"],
        req_pool_indices=torch.tensor(reqs, device=d),
        positions=b["positions"],
        out_cache_loc=sess.req_to_token[torch.tensor(b["reqs"], device=d), b["positions"]].long(),
        seq_lens=torch.tensor([HISTORY[r] + width for r in reqs], device=d),
        seq_lens_cpu=None,
        seq_lens_sum=None,
        extend_seq_lens=torch.full((len(reqs),), width, dtype=torch.int32, device=d),
        extend_seq_lens_cpu=[width] * len(reqs),
        mrope_positions=None,
        mamba_track_indices=None,
        spec_info=b["spec"](),
        max_seq_len_host=None,
        out_cache_loc_virtual=None,
        kv_loc_plan=None,
        kv_loc_cols=None,
        global_num_tokens_cpu=None,
    )


def prefill_history(sess, cfg):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    for r, n in HISTORY.items():
        S, T = data_for(cfg, n, 100 + r)
        sess.run(ForwardMode.EXTEND, [r] * n, list(range(n)), T, S, ragged=[n])


ROUNDS = lambda width: [
    ([1, 2, 3], [width, 1, min(2, width)]),
    ([1], [width]),  # noqa: E731
    ([4, 2, 1, 3], [1, width, 1, width]),
]


def graph_vs_eager_rounds(
    monkeypatch,
    draft,
    cfg,
    steps: int,
    swa: bool,
    device: str = "cpu",
    graphs_cls=EmulatedGraphs,
    tol: float = 1e-5,
    record_writes: bool = True,
) -> dict:
    """Capture through SGLang's runner, then rounds of 3 requests (padded to 4), 1 (padded to 4) and 4: per round
    the eager DRAFT_EXTEND_V2 forward and the graph form from the same pool state; asserts equal selected logits,
    draft streams and pool rows, capture / padded rows touching nothing but the padding page. Returns the
    runner, the session and the last round's batch."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    sess = session(draft, cfg, swa, device)
    prefill_history(sess, cfg)
    pad = slice(0, PAGE)  # the draft pool's padding page (slot 0 and, with SWA slots, SWA slot 0)
    live = pool_rows(sess).clone()
    runner = build_runner(monkeypatch, sess, draft, cfg, steps, graphs_cls)
    after_capture = pool_rows(sess)
    assert runner.captured_req_width == steps + 1 and runner.max_bs == max(CAPTURE_BS)
    assert torch.equal(after_capture[PAGE:], live[PAGE:]), "capture wrote a live draft-pool row"

    writes: list[torch.Tensor] = []
    if record_writes:  # Python-level: sees the emulated replays (a CUDA graph replays without Python)
        rows_write = sess.pool.rows.write

        def recording_write(loc, x):
            writes.append(loc.clone())
            return rows_write(loc, x)

        monkeypatch.setattr(sess.pool.rows, "write", recording_write)
    width = steps + 1
    rounds = ROUNDS(width)
    for i, (reqs, accept) in enumerate(rounds):
        b = round_batch(cfg, reqs, steps, seed=10 * steps + i, accept=accept, device=device)
        before = pool_rows(sess).clone()
        # eager DRAFT_EXTEND_V2 (what SGLang runs without the graph): every row, selected afterwards
        with torch.no_grad():
            logits, R = sess.run(
                ForwardMode.DRAFT_EXTEND_V2, b["reqs"], b["positions"], b["tokens"], b["streams"]
            )
        eager = pool_rows(sess).clone()
        pool_rows(sess).copy_(before)
        # graph form through SGLang's runner
        writes.clear()
        fb = forward_batch_for(sess, b, reqs)
        assert runner.can_run_graph(fb)
        out = runner.execute(fb, b["select_index"])
        assert runner.bs == max(CAPTURE_BS) and runner.raw_bs == len(reqs)
        sel = b["select_index"]
        torch.testing.assert_close(out.next_token_logits.float(), logits[sel], rtol=tol, atol=tol)
        torch.testing.assert_close(out.hidden_states.float(), R[sel].flatten(1), rtol=tol, atol=tol)
        graph = pool_rows(sess)
        written = torch.zeros(graph.shape[0], dtype=torch.bool, device=graph.device)
        written[sess.pool.window_loc(fb.out_cache_loc)] = True
        assert not written[pad].any()
        torch.testing.assert_close(graph[written], eager[written], rtol=tol, atol=tol)
        untouched = ~written
        untouched[pad] = False
        assert torch.equal(graph[untouched], before[untouched]), "a padded / stale row wrote a live pool row"
        assert torch.equal(eager[pad], before[pad])  # the eager forward never touches the padding page
        if (
            record_writes
        ):  # every row the replay wrote: the batch's live rows, padded requests' to the padding page
            assert len(writes) == 1  # one draft layer: one pool write per forward
            locs = writes[0].flatten()
            n_live = fb.out_cache_loc.numel()
            assert locs.numel() == runner.bs * width
            assert torch.equal(locs[:n_live], sess.pool.window_loc(fb.out_cache_loc))
            assert bool((locs[n_live:] < PAGE).all()) and (len(reqs) < runner.bs) == (locs.numel() > n_live)
        pool_rows(sess).copy_(eager)  # both paths continue from the same state
    assert runner.backend.replays == len(rounds)
    assert sess.backend.graph_replays.get("DRAFT_EXTEND_V2") == len(rounds)
    return {"runner": runner, "sess": sess, "batch": (b, fb, reqs)}


@pytest.mark.parametrize("swa", [False, True], ids=["full-slots", "swa-slots"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_draft_extend_graph_form_equals_eager(draft_setup, monkeypatch, steps, swa):
    cfg, draft = draft_setup
    graph_vs_eager_rounds(monkeypatch, draft, cfg, steps, swa)


def test_stale_capture_time_metadata_is_caught(draft_setup, monkeypatch):
    """Control: a backend that builds its row -> request map outside the graph (in
    `init_forward_metadata_out_graph`, from the capture-time batch) gives wrong replays here, as it would on the
    GPU (the graph keeps reading the capture-time tensor): the emulation can fail."""
    cfg, draft = draft_setup
    sess = session(draft, cfg, swa=False)
    prefill_history(sess, cfg)
    be = sess.backend
    orig = type(be).init_forward_metadata_out_graph

    def outside_graph(self, fb, in_capture=False):
        orig(self, fb, in_capture)
        k = fb.spec_info.num_tokens_per_req if fb.spec_info is not None else 1
        self._row_reqs = fb.req_pool_indices.repeat_interleave(k).clone()  # a new tensor: not captured memory

    monkeypatch.setattr(type(be), "init_forward_metadata_out_graph", outside_graph)
    runner = build_runner(monkeypatch, sess, draft, cfg, steps=2)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = round_batch(cfg, [1, 2, 3], 2, seed=7, accept=[3, 3, 3])
    before = pool_rows(sess).clone()
    monkeypatch.setattr(type(be), "init_forward_metadata_out_graph", orig)
    logits, _ = sess.run(ForwardMode.DRAFT_EXTEND_V2, b["reqs"], b["positions"], b["tokens"], b["streams"])
    pool_rows(sess).copy_(before)
    monkeypatch.setattr(type(be), "init_forward_metadata_out_graph", outside_graph)
    out = runner.execute(forward_batch_for(sess, b, [1, 2, 3]), b["select_index"])
    assert not torch.allclose(out.next_token_logits.float(), logits[b["select_index"]], rtol=1e-3, atol=1e-3)


def test_tripwire_catches_host_reads():
    """The tripwire itself: `.item()`, `bool(t)`, nonzero, `.tolist()`, a tensor-repeats repeat_interleave and a
    boolean mask fail; static ops (an index tensor, repeat_interleave by an int or with output_size) pass."""
    t = torch.arange(4)
    for bad in (
        lambda: t.sum().item(),
        lambda: bool(t.any()),
        lambda: t.nonzero(),
        lambda: t.tolist(),
        lambda: t.repeat_interleave(t),
        lambda: t[t > 1],
    ):
        with pytest.raises(HostSyncError), graph_tripwire():
            bad()
    with graph_tripwire() as m:
        t.repeat_interleave(3)
        t.repeat_interleave(t, output_size=6)
        (t * 2)[t.clamp(max=2)]
    assert m.ops > 0
