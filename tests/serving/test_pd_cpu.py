"""PD disaggregation over the ERNIE-5.5 pools (docs/serving-design.md section 10), on CPU.

- The buffer map (`sglang_ernie55.mem_cache.pd_layout`): SGLang's state-component setup, through the ledger's hook, lists
  every pool buffer once in the addressing SGLang transfers it by (full pages, SWA pages, open-block state rows;
  the ECHO draft's rows a second SWA component); a transfer done the way the Mooncake backend addresses it
  (`ptr + index * item_len` on both sides, by the index lists both servers compute) between two pools with
  other pages, other SWA pages, another request slot and another state ring gives the decode pool the prefill
  pool's rows, entries and open-block state, byte for byte.
- Real `--device cpu` servers (slow): a prefill and a decode server (`--disaggregation-mode prefill|decode
  --disaggregation-transfer-backend mooncake`, Mooncake over TCP on loopback) give a single server's greedy tokens,
  for prompts longer than the HCA window and ending inside a compression block, and agree with the reference
  (cached tensors rounded as the pool stores them) where it does; a decode server whose prefill peer dies aborts the request with an
  error naming the peer, returns its pool to idle and serves again once a prefill server is back; ECHO on both
  servers with the ECHO-exact checkpoint accepts every draft and gives the reference's tokens.
  tests/serving/pd_harness.py sends each request to both servers, as SGLang's PD router does, so the decode
  server's own answer is seen; tests/serving/pd_cpu_shim/ keeps SGLang's prefill send off CUDA events
  (docs/hooks.md, "Test-only shims").
- Behind SGLang's router (`sglang_router`, the `pd` extra): its `/generate` and OpenAI `/v1/completions` give a
  single server's greedy tokens; the prefill server SIGKILLed while a request's KV is on its way and two more wait:
  the decode server answers the three with an error naming the lost peer, finishes a request already decoding,
  frees every page and serves again through the router once a prefill server is back.
The server tests skip, naming the package, without Mooncake's transfer engine (`pip install -e '.[pd]'` and
Debian's `libibverbs1`) or, for the router's, without `sglang_router`.
"""

from __future__ import annotations

import ctypes
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from sglang_ernie55.mem_cache import pd
from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool
from tests.echo import echo_checks
from tests.serving import pd_harness as ph
from tests.serving import server_harness as sh
from tests.serving.geometries import VARIANTS
from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

PAGE = 256
FULL_PAGES, SWA_PAGES = 6, 3
DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "float32": torch.float32}


def _config(name: str):
    return next(v for v in VARIANTS if v.name == name).config()


def _kv_args(pool, draft=None):
    """SGLang's KV-args fields of one server: KV data from the pool (and the draft's, as SGLang appends it),
    state components through the ledger's hook around SGLang's own `setup_state_kv_args`."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import setup_state_kv_args

    args = SimpleNamespace()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    if draft is not None:
        for mine, theirs in zip(
            (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens), draft.get_contiguous_buf_infos()
        ):
            mine += theirs
    pd.around_setup_state_kv_args(setup_state_kv_args, args, pool, draft, pool.layer_num, None)
    return args


def _copy(src_ptrs, dst_ptrs, src_items, dst_items, src_idx, dst_idx) -> None:
    """What the Mooncake backend does for one component: entry e, index pair (i, j): item_len bytes from
    src_ptr + i * item_len to dst_ptr + j * item_len (the prefill side's item_len; both sides must agree)."""
    assert len(src_ptrs) == len(dst_ptrs) and list(src_items) == list(dst_items)
    assert len(src_idx) == len(dst_idx)
    for s, d, n in zip(src_ptrs, dst_ptrs, src_items):
        for i, j in zip(src_idx, dst_idx):
            ctypes.memmove(d + int(j) * n, s + int(i) * n, n)


class _Side:
    """One server's pool (and ECHO draft pool), a request at `pages` (full-pool pages in position order) in
    request slot `slot`, SWA page `swa_pages[k]` for full page `pages[k]`."""

    def __init__(self, cfg, kv, hybrid, pages, swa_pages, slot, state_blocks, echo):
        swa = SWA_PAGES * PAGE if hybrid else None
        self.pool = Ernie55TokenToKVPool(
            FULL_PAGES * PAGE,
            PAGE,
            DTYPES[kv],
            cfg,
            num_req_slots=3,
            device="cpu",
            swa_size=swa,
            state_blocks=state_blocks,
        )
        self.draft = (
            EchoDraftKVPool(FULL_PAGES * PAGE, PAGE, DTYPES[kv], cfg, device="cpu", swa_size=swa)
            if echo
            else None
        )
        self.pages, self.slot = pages, slot
        if hybrid:
            m = torch.zeros(FULL_PAGES * PAGE + PAGE + 1, dtype=torch.int64)
            m[-1] = -1
            for f, s in zip(pages, swa_pages):
                m[f * PAGE : (f + 1) * PAGE] = torch.arange(s * PAGE, (s + 1) * PAGE)
            self.pool.register_mapping(m)
            if self.draft is not None:
                self.draft.register_mapping(m)
        self.args = _kv_args(self.pool, self.draft)

    def loc(self, n: int) -> torch.Tensor:
        return (torch.tensor(self.pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]

    def kv_pages(self, n: int):
        return self.loc(n)[::PAGE] // PAGE

    def swa_pages(self, n: int, window: int):
        """SGLang's `_swa_payload`: the SWA pages of positions page_floor(n - window) .. n - 1."""
        start = max(0, n - window) // PAGE * PAGE
        return self.pool.window_loc(self.loc(n)[start:])[::PAGE] // PAGE

    def rows(self, n: int, cfg) -> dict:
        """Everything a decode step of this request reads, decoded through the pool's codecs."""
        p, loc = self.pool, self.loc(n)
        window = loc[max(0, n - cfg.window_size) :]
        out = {}
        for lid, rows in p.win.items():
            out[("window", lid)] = rows.read(p.window_loc(window))
        blocks = torch.arange(n // cfg.compress_ratio)
        for lid, rows in p.cmp.items():
            out[("compressed", lid)] = rows.read(loc[blocks * cfg.compress_ratio] // cfg.compress_ratio)
        for lid, rows in p.latent.items():
            out[("latent", lid)] = rows.read(loc)
        for lid, rows in p.index_k.items():
            out[("index", lid)] = rows.read(loc)
        state_rows = torch.as_tensor(p.request_state_transfer_indices(self.slot, n)).long()
        for lid, t in p.state.items():
            out[("state", lid)] = t.view(-1, t.shape[-1])[state_rows]
        if self.draft is not None:
            out[("draft", self.draft.layer_id)] = self.draft.rows.read(self.draft.window_loc(window))
        return out


def _fill_random(side: _Side, g: torch.Generator) -> None:
    for t in side.pool._all_buffers() + (side.draft.rows.buffers() if side.draft else []):
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g))


def _transfer(src: _Side, dst: _Side, n: int, window: int) -> None:
    """Prefill -> decode of a request of n tokens by the index lists SGLang's two queues compute."""
    from sglang.srt.disaggregation.base.conn import StateType

    a, b = src.args, dst.args
    _copy(a.kv_data_ptrs, b.kv_data_ptrs, a.kv_item_lens, b.kv_item_lens, src.kv_pages(n), dst.kv_pages(n))
    assert a.state_types == b.state_types
    for i, st in enumerate(a.state_types):
        if st == StateType.SWA:
            idx = src.swa_pages(n, window), dst.swa_pages(n, window)
        elif st == StateType.DSV4_REQUEST_STATE:
            idx = (
                src.pool.request_state_transfer_indices(src.slot, n),
                dst.pool.request_state_transfer_indices(dst.slot, n),
            )
        else:
            raise AssertionError(f"unexpected state component {st}")
        _copy(a.state_data_ptrs[i], b.state_data_ptrs[i], a.state_item_lens[i], b.state_item_lens[i], *idx)


@pytest.mark.parametrize("echo", [False, True], ids=["target", "echo"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["swa", "full_slots"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "float32"])
@pytest.mark.parametrize("geometry", ["tiny", "w128_c32_r3_mla_first", "mla_last_no_shared"])
def test_transfer_gives_the_decode_pool_the_prefill_pools_rows(geometry, kv, hybrid, echo):
    """A 300-token request (past the window, 44 tokens into an open block at ratio 128, 12 at ratio 32) moved
    between two pools whose pages, SWA pages, request slots and state rings (one block on the prefill side, two on a
    speculating decode side) all differ: every row a decode step reads is the prefill pool's."""
    cfg = _config(geometry)
    n = 300
    g = torch.Generator().manual_seed(0)
    prefill = _Side(cfg, kv, hybrid, [1, 2], [2, 1], slot=0, state_blocks=1 + echo, echo=echo)
    decode = _Side(cfg, kv, hybrid, [5, 3], [1, 2], slot=2, state_blocks=2, echo=echo)
    _fill_random(prefill, g)
    _fill_random(decode, g)
    want = prefill.rows(n, cfg)
    before = decode.rows(n, cfg)
    _transfer(prefill, decode, n, cfg.window_size)
    got = decode.rows(n, cfg)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
        assert not torch.equal(before[key], want[key]) or want[key].numel() == 0, key
    assert any(k[0] == "state" for k in want) and want[next(k for k in want if k[0] == "state")].shape[0] == (
        n % cfg.compress_ratio
    )


def _named_buffers(pool) -> dict:
    """data pointer -> (buffer name, layer) of every tensor of the pool (PoolLayout's names)."""
    out = {t.data_ptr(): ("state", lid) for lid, t in pool.state.items()}
    for name, store in (("window", pool.win), ("compressed", pool.cmp), ("latent", pool.latent)):
        out.update({codec.buffers()[0].data_ptr(): (name, lid) for lid, codec in store.items()})
    out.update({codec.buffers()[0].data_ptr(): ("index", lid) for lid, codec in pool.index_k.items()})
    want = [
        (b.name, b.layer)
        for b in pool.layout.buffers(pool.size, pool.swa_size if pool.is_hybrid_swa else None, 3)
    ]
    assert sorted(out.values()) == sorted(want)
    return out


def test_every_buffer_is_listed_once_in_one_addressing():
    """KV data: compressed entries, latents and indexer keys (and the window rows without an SWA pool), one page
    per item, page p of every buffer = full page p; `StateType.SWA`: the window rows per HCA layer, then the ECHO
    draft's as a second component; `StateType.DSV4_REQUEST_STATE`: the open-block state, one position per item.
    Together they are `PoolLayout.buffers` (and the draft's), each once."""
    from sglang.srt.disaggregation.base.conn import StateType

    cfg = _config("tiny")
    for hybrid in (True, False):
        side = _Side(cfg, "bfloat16", hybrid, [1, 2], [2, 1], slot=0, state_blocks=2, echo=True)
        p, a = side.pool, side.args
        ptrs = _named_buffers(p)
        ptrs[side.draft.rows.buffers()[0].data_ptr()] = ("draft", cfg.num_hidden_layers - 1)
        listed = [ptrs[x] for x in a.kv_data_ptrs] + [ptrs[x] for comp in a.state_data_ptrs for x in comp]
        assert sorted(listed) == sorted(ptrs.values())
        kv_names = {ptrs[x][0] for x in a.kv_data_ptrs}
        if hybrid:
            assert a.state_types == [StateType.SWA, StateType.DSV4_REQUEST_STATE, StateType.SWA]
            assert [ptrs[x][0] for x in a.state_data_ptrs[0]] == ["window"] * 3
            assert [ptrs[x][0] for x in a.state_data_ptrs[2]] == ["draft"]
            assert kv_names == {"compressed", "latent", "index"}
        else:
            assert a.state_types == [StateType.DSV4_REQUEST_STATE]
            assert kv_names == {"compressed", "latent", "index", "window", "draft"}
        for ptr, item in zip(a.kv_data_ptrs, a.kv_item_lens):
            name = ptrs[ptr][0]
            per_page = PAGE // cfg.compress_ratio if name == "compressed" else PAGE
            assert item % per_page == 0
        state = a.state_types.index(StateType.DSV4_REQUEST_STATE)
        assert a.state_item_lens[state] == [2 * cfg.head_dim * 4] * 3


def test_pd_hooks_take_our_pool_only():
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import is_mla_backend, setup_state_kv_args

    cfg = _config("tiny")
    pool = Ernie55TokenToKVPool(FULL_PAGES * PAGE, PAGE, torch.bfloat16, cfg, num_req_slots=3, device="cpu")
    assert pd.around_is_mla_backend(is_mla_backend, pool) is True
    assert pd.around_is_mla_backend(is_mla_backend, object()) is False
    args = SimpleNamespace()
    calls = []
    pd.around_setup_state_kv_args(lambda *a, **k: calls.append(a), args, object(), None)
    assert len(calls) == 1
    with pytest.raises(NotImplementedError, match="EchoDraftKVPool"):
        pd.around_setup_state_kv_args(setup_state_kv_args, args, pool, object(), 4, None)
    # the decode queue allocates SWA slots for the window tail of a prompt only, with SGLang's SWA allocator
    hybrid = Ernie55TokenToKVPool(
        FULL_PAGES * PAGE, PAGE, torch.bfloat16, cfg, num_req_slots=3, device="cpu", swa_size=SWA_PAGES * PAGE
    )
    swa_alloc = SimpleNamespace(page_size=PAGE, alloc_extend_swa_tail=None)
    never = lambda self: pytest.fail("SGLang's own answer asked for our pool")  # noqa: E731
    queue = SimpleNamespace(token_to_kv_pool=hybrid, token_to_kv_pool_allocator=swa_alloc)
    assert pd.around_uses_swa_tail_prealloc(never, queue) is True
    queue.token_to_kv_pool_allocator = SimpleNamespace(page_size=PAGE)
    assert pd.around_uses_swa_tail_prealloc(never, queue) is False
    for other in (pool, object()):  # no SWA pool, another pool: SGLang's answer
        queue = SimpleNamespace(token_to_kv_pool=other, token_to_kv_pool_allocator=swa_alloc)
        assert pd.around_uses_swa_tail_prealloc(lambda self: "sglang", queue) == "sglang"
    with pytest.raises(ValueError, match=r"req_pool_idx must be in \[0, 3\)"):
        pool.request_state_transfer_indices(3, 10)
    assert pool.request_state_transfer_indices(1, 256).size == 0  # a block boundary: no open block


# ------------------------------------------------------------------ real servers
LENGTHS = (19, 125, 129, 250, 300, 512, 700)  # window 128 / ratio 128 / page 256
NEW_TOKENS = 8
# a decode server cannot retract (it would have to prefill again): SGLang aborts a request when a decode step finds
# no free SWA page, so its SWA pool must hold every running request's window pages and their growth; 0.5 of the
# 8192-token pool (16 pages) holds the test's 7 concurrent requests
# Logprob agreement with the single server. A request served alone on both sides runs the same batch shapes, so
# its logprobs agree to fp32 rounding. Requests served together do not: the decode server's batches form as
# transfers finish, CPU GEMMs round by batch shape, and a last-bit difference in a K/V row can move its bf16
# rounding in the pool by one bf16 ulp (2^-8 relative), which moves the tiny random model's logprobs by up to a
# few 1e-3. A lost or misplaced page changes the attention of every later token.
ALONE_LP_TOL = 1e-4
BATCHED_LP_TOL = 0.05
FLAGS = sh.cpu_flags(
    disable_cuda_graph=True,
    swa_full_tokens_ratio=0.5,
    chunked_prefill_size=512,
    sampling_backend="pytorch",
)


def _prompts(cfg, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


def _score(path, cfg, prompts, outs):
    _, ref = sh.load_reference(path, "cpu")
    with sh.kv_rounded_reference("bfloat16", cfg):
        return sh.score(ref, prompts, outs, "cpu")


def _env(shim=ph.SHIM) -> dict:
    return {"PYTHONPATH": shim_pythonpath(shim)}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("pd") / "bf16", dtype="bf16", seed=0)


def _single_server(path, prompts, flags=FLAGS, name="pd-cpu-single") -> tuple[list[dict], float]:
    """The same requests (the first alone, the rest at once) on one server with the same flags: the outputs PD
    must give, and its start-up seconds."""
    server = sh.Server(path, *flags, log_name=name)
    try:
        outs = [_generate(server.url, prompts[0])]
        with ThreadPoolExecutor(8) as ex:
            outs += list(ex.map(lambda p: _generate(server.url, p), prompts[1:]))
    finally:
        server.stop()
    return outs, server.startup_s


def _generate(url: str, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> dict:
    body = dict(
        input_ids=prompt,
        sampling_params=dict(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
        return_logprob=True,
    )
    r = requests.post(url + "/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    return {
        "tokens": out["output_ids"],
        "logprobs": [x[0] for x in out["meta_info"]["output_token_logprobs"]],
    }


@pytest.mark.slow
def test_pd_servers_without_an_swa_pool_give_a_single_servers_tokens(tiny_ckpt):
    """`--disable-hybrid-swa-memory` on both servers: the window rows sit at full slots and go as KV data pages (no
    SWA component); 3 prompts (19 / 129 / 300 tokens) x 8 greedy tokens = a single server's."""
    reason = ph.mooncake_missing()
    if reason:
        pytest.skip(reason)
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    prompts = _prompts(cfg, (19, 129, 300), seed=2)
    flags = sh.cpu_flags(disable_cuda_graph=True, disable_hybrid_swa_memory=True, sampling_backend="pytorch")
    single, _ = _single_server(tiny_ckpt, prompts, flags, "pd-cpu-full-slots-single")
    pair = ph.PDPair(tiny_ckpt, *flags, env=_env(), log_name="pd-cpu-full-slots")
    try:
        outs = [pair.generate(prompts[0], NEW_TOKENS)] + pair.generate_all(prompts[1:], NEW_TOKENS)
        log = pair.decode.log_path.read_text(errors="replace")
    finally:
        pair.stop()
    s = _score(tiny_ckpt, cfg, prompts, outs)
    same = sum(a == b for o, x in zip(outs, single) for a, b in zip(o["tokens"], x["tokens"]))
    report = {"tokens_equal_to_single": f"{same}/{len(prompts) * NEW_TOKENS}", "pd_vs_reference": s.summary()}
    print(f"\n[pd cpu full slots] {report}")
    sh.write_report("pd_cpu_full_slots", report)
    assert "mode=full-only" in log, "the decode server ran with an SWA pool"
    assert same == len(prompts) * NEW_TOKENS, report


def _draft_extends(dump_dir) -> dict:
    """The ECHO draft's extend forwards a server dumped (`SGLANG_ERNIE55_ECHO_DUMP_DIR`), by (input ids, positions):
    its output hidden state."""
    out = {}
    for f in sorted(dump_dir.glob("echo-*.pt")):
        d = torch.load(f)
        out[(tuple(d["input_ids"].tolist()), tuple(d["positions"].tolist()))] = d["hidden"].float()
    return out


def _draft_extends_vs_single(decode_dump, single_dump) -> tuple[int, int, float]:
    """(matched, total, max diff): the decode server's draft extends matched with the single server's by their
    tokens and positions (its own warm-up's extends have no match), and the largest hidden-state difference of
    the matched ones (inf when none matched)."""
    mine, theirs = _draft_extends(decode_dump), _draft_extends(single_dump)
    matched = [k for k in mine if k in theirs]
    diff = max((float((mine[k] - theirs[k]).abs().max()) for k in matched), default=float("inf"))
    return len(matched), len(mine), diff


@pytest.mark.slow
def test_pd_servers_with_echo_match_a_single_echo_server(tmp_path):
    """ECHO (2 draft steps) on both servers with the ECHO-exact checkpoint (docs/echo.md section 7): the prefill
    server runs the target and the draft over the prompt and sends both pools' rows and the draft's first input;
    the decode server verifies with the two-block state ring, every draft it proposes is accepted, and the tokens
    are the reference's. The draft's extends on the decode server (after each verify, over the window rows the
    prefill server wrote and sent) give a single ECHO server's hidden states for the same tokens: the draft's
    window rows arrived. SGLang's EAGLE helper kernels run in Triton's interpreter (tests/echo/cpu_spec_shim)."""
    reason = ph.mooncake_missing()
    if reason:
        pytest.skip(reason)
    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.reference.echo import write_echo_exact_checkpoint

    path, _ = write_echo_exact_checkpoint(tmp_path / "exact", seed=0)
    cfg = tiny_config()
    prompts = _prompts(cfg, (19, 126, 254, 300), seed=1)
    spec = echo_checks.spec_flags(2)
    env = {**_env(ph.ECHO_SHIM), "TRITON_INTERPRET": "1"}
    single_dump, decode_dump = tmp_path / "single", tmp_path / "decode"
    single_dump.mkdir()
    decode_dump.mkdir()
    single = sh.Server(
        path,
        *FLAGS,
        *spec,
        log_name="pd-cpu-echo-single",
        env={**env, "SGLANG_ERNIE55_ECHO_DUMP_DIR": str(single_dump)},
        timeout=900,
    )
    try:
        single_outs = [_generate(single.url, p, 10) for p in prompts]
    finally:
        single.stop()
    t0 = time.time()
    pair = ph.PDPair(
        path,
        *FLAGS,
        *spec,
        env=env,
        decode_env={"SGLANG_ERNIE55_ECHO_DUMP_DIR": str(decode_dump)},
        log_name="pd-cpu-echo",
    )
    try:
        up_s = time.time() - t0
        outs = [pair.generate(p, 10, meta=True) for p in prompts]
    finally:
        pair.stop()
    s = _score(path, cfg, prompts, outs)
    metas = [o["meta"] for o in outs]
    # the decode server's draft extends after each verify, over the accepted tokens (the target's tokens are
    # equal, checked below)
    matched, total, diff = _draft_extends_vs_single(decode_dump, single_dump)
    report = {
        "startup_s": round(up_s),
        "summary": s.summary(),
        "tokens_equal_to_single": [o["tokens"] == x["tokens"] for o, x in zip(outs, single_outs)],
        "decode_draft_extends": f"{matched} matched of {total}",
        "max_hidden_diff_to_single": diff,
    }
    report["drafts"] = [(m.get("spec_num_correct_drafts"), m.get("spec_num_proposed_drafts")) for m in metas]
    print(f"\n[pd cpu echo] {report}")
    sh.write_report("pd_cpu_echo", report)
    assert s.top1 == s.positions, (s.summary(), s.mismatches)
    assert all(o["tokens"] == x["tokens"] for o, x in zip(outs, single_outs)), report
    assert all(m.get("spec_verify_ct", 0) >= 1 for m in metas), metas
    assert all(m["spec_num_correct_drafts"] == m["spec_num_proposed_drafts"] for m in metas), metas
    assert matched >= 3 * len(prompts), report  # 3 verify rounds per request, each followed by an extend
    assert diff <= 1e-4, report


# ------------------------------------------------------------------ server arguments
@pytest.fixture(scope="module")
def ernie_config(tmp_path_factory) -> str:
    import json

    from sglang_ernie55.configuration import tiny_config

    path = tmp_path_factory.mktemp("ernie55")
    (path / "config.json").write_text(json.dumps(tiny_config().to_config_json()))
    return str(path)


def test_pd_flags_resolve_with_mooncake_and_refuse_other_backends(ernie_config):
    from sglang_ernie55.args import Ernie55ArgumentError, resolve_server_args

    def resolve(*flags):
        return resolve_server_args(["--model-path", ernie_config, *flags], device="cpu").resolved_dict()

    for mode in ("prefill", "decode"):
        d = resolve("--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake")
        assert d["disaggregation_mode"] == mode and d["disaggregation_transfer_backend"] == "mooncake"
        with pytest.raises(Ernie55ArgumentError) as e:
            resolve("--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl")
        assert e.value.flag == "--disaggregation-transfer-backend" and e.value.legal == "mooncake"
    resolve("--disaggregation-transfer-backend", "nixl")  # not a PD server: not our concern


# ------------------------------------------------------------------ one PD pair, behind SGLang's router
# The tests below share one prefill + decode server pair (and the router over it), started by the first of them
# and stopped after the last: each CPU server start costs 1-3 minutes on 2 cores. Each test leaves the pair as it
# found it: a live prefill server on the same HTTP and bootstrap ports, the decode pool back at its idle usage.
# They stay at the end of this module: module fixtures are torn down only at its end, and an idle SGLang server
# polls its queues, taking CPU from every other server test.
ROUTER_TEXTS = (
    "A short prompt through the router.",
    " ".join(f"Line {i} of a prompt longer than the HCA window, sent as text." for i in range(8)),
)
# the router's own failure handling is for many workers: a retry, the circuit breaker and health checks can only
# pick the same single prefill server again (measured with its defaults: the in-flight requests answered 503 "No
# available prefill workers (all circuits open or unhealthy)" after three retries, 49 s after the kill, and the
# restarted prefill server stayed unpicked until health checks saw it); off, the router passes the decode
# server's answer through
ROUTER_FLAGS = (
    "--policy",
    "round_robin",
    "--disable-retries",
    "--disable-circuit-breaker",
    "--disable-health-check",
)
KEEPS_DECODING_TOKENS = 200  # a request decoding while its prefill server dies (after its transfer completed)
LONG = 2000  # tokens of each prompt in flight when the prefill server dies: 4 chunks of --chunked-prefill-size 512


# decided when the module is collected, so that a skipped test starts none of the module's servers (fixtures are
# set up before a test body could skip)
NO_MOONCAKE = ph.mooncake_missing()
NO_ROUTER = NO_MOONCAKE or ph.router_missing()
needs_mooncake = pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))
needs_router = pytest.mark.skipif(NO_ROUTER is not None, reason=str(NO_ROUTER))


def _complete(url: str, model: str, text: str, max_tokens: int = NEW_TOKENS) -> dict:
    """One greedy `/v1/completions` request with a text prompt (SGLang's router takes a prompt as text only)."""
    body = dict(
        model=model,
        prompt=text,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        return_token_ids=True,
        ignore_eos=True,
    )
    r = requests.post(url + "/v1/completions", json=body, timeout=900)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    ch = out["choices"][0]
    return {
        "tokens": ch["token_ids"],
        "logprobs": ch["logprobs"]["token_logprobs"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
    }


def _idle(url: str, idle: int, timeout: float, what: str) -> float:
    """Seconds until the server runs no request and uses its idle token count (SGLang frees a PD request's decode
    pages once the prefill side acks the transfer's drain, or 30 s without an ack)."""
    t0 = time.time()
    ph.wait_until(
        lambda: (lambda x: x if x["num_running_reqs"] == 0 and x["num_used_tokens"] == idle else None)(
            ph.loads(url)
        ),
        timeout,
        f"the decode pool back to its idle {idle} used tokens {what}",
    )
    return time.time() - t0


@pytest.fixture(scope="module")
def single(tiny_ckpt):
    """What a single server with the pair's flags answers to every request the pair tests send: the 7 LENGTHS
    prompts (the first alone, then the rest at once) on `/generate`, the router's text prompts on
    `/v1/completions`, and the request that keeps decoding while the prefill server dies."""
    from sglang_ernie55.configuration import tiny_config

    prompts = _prompts(tiny_config(), LENGTHS)
    server = sh.Server(tiny_ckpt, *FLAGS, log_name="pd-cpu-single")
    try:
        outs = [_generate(server.url, prompts[0])]
        with ThreadPoolExecutor(8) as ex:
            outs += list(ex.map(lambda p: _generate(server.url, p), prompts[1:]))
        texts = [_complete(server.url, server.model, t) for t in ROUTER_TEXTS]
        keeps_decoding = _generate(server.url, prompts[1], KEEPS_DECODING_TOKENS)
    finally:
        server.stop()
    return {
        "prompts": prompts,
        "outs": outs,
        "texts": texts,
        "keeps_decoding": keeps_decoding,
        "startup_s": server.startup_s,
    }


@pytest.fixture(scope="module")
def pd_pair(tiny_ckpt):
    t0 = time.time()
    # Mooncake's transfer engine logs the bytes it moved each second (the prefill server's log: what it had sent
    # when it died)
    metrics = {"MC_TE_METRIC": "1", "MC_TE_METRIC_INTERVAL_SECONDS": "1"}
    pair = ph.PDPair(tiny_ckpt, *FLAGS, env={**_env(), **metrics}, log_name="pd-cpu")
    pair.up_s = time.time() - t0
    yield pair
    pair.stop()


@pytest.fixture(scope="module")
def pd_router(pd_pair):
    router = ph.Router(pd_pair, *ROUTER_FLAGS)
    yield router
    router.stop()


@pytest.mark.slow
@needs_mooncake
def test_pd_servers_give_a_single_servers_tokens_and_survive_a_lost_prefill(tiny_ckpt, single, pd_pair):
    """Prefill + decode servers, Mooncake over TCP: 7 prompts of 19-700 tokens (past the 128-token window; all but
    the 512-token one end inside a compression block), one alone, then all at once, 8 greedy tokens each: the
    decode server's tokens are a single server's (same flags, same requests), and agree with the KV-rounded
    reference as often as the single server's do. Then the prefill server is killed while a request waits on the
    decode server for its KV: the decode server answers it with an error naming the lost prefill peer, its pool
    returns to the idle usage, and with a new prefill server on the same bootstrap port it serves a single
    server's tokens again."""
    from sglang_ernie55.configuration import tiny_config

    cfg = tiny_config()
    pair, prompts, single_outs = pd_pair, single["prompts"], single["outs"]
    idle = ph.loads(pair.decode.url)["num_used_tokens"]
    t1 = time.time()
    outs = [pair.generate(prompts[0], NEW_TOKENS)]
    outs += pair.generate_all(prompts[1:], NEW_TOKENS)
    serve_s = time.time() - t1
    failure = _lose_the_prefill_server(pair, prompts[-1], idle)
    again = pair.generate(prompts[3], NEW_TOKENS)
    # the decode server frees a finished request's pages once the prefill server acks the transfer's drain
    idle_again_s = _idle(pair.decode.url, idle, 120, "after the last request")
    s = _score(tiny_ckpt, cfg, prompts, outs)
    s_single = _score(tiny_ckpt, cfg, prompts, single_outs)
    same = sum(a == b for o, x in zip(outs, single_outs) for a, b in zip(o["tokens"], x["tokens"]))
    lp_diff = max(abs(a - b) for o, x in zip(outs, single_outs) for a, b in zip(o["logprobs"], x["logprobs"]))
    lp_alone = max(abs(a - b) for a, b in zip(outs[0]["logprobs"], single_outs[0]["logprobs"]))
    report = {
        "startup_s": round(pair.up_s),
        "single_startup_s": round(single["startup_s"]),
        "serve_s": round(serve_s),
        "tokens_equal_to_single": f"{same}/{len(prompts) * NEW_TOKENS}",
        "max_logprob_diff_to_single": lp_diff,
        "logprob_diff_to_single_alone": lp_alone,
        "pd_vs_reference": s.summary(),
        "single_vs_reference": s_single.summary(),
        "idle_used_tokens": idle,
        "idle_again_s": round(idle_again_s, 1),
        **failure,
    }
    print(f"\n[pd cpu] {report}")
    sh.write_report("pd_cpu", report)
    assert same == len(prompts) * NEW_TOKENS and again["tokens"] == single_outs[3]["tokens"], report
    assert lp_alone <= ALONE_LP_TOL and lp_diff <= BATCHED_LP_TOL, report
    assert s.top1 == s_single.top1 and s.mismatches == s_single.mismatches, (s.summary(), s_single.summary())
    assert failure["status"] >= 500 and "Lost connection with prefill instance" in failure["error"], failure
    assert failure["used_while_waiting"] > idle, failure  # the waiting request held pages
    assert failure["used_after_abort"] == idle, (idle, failure)


def _lose_the_prefill_server(pair: ph.PDPair, prompt: list[int], idle: int) -> dict:
    """A request sent to the decode server only: it pre-allocates the request's pages and waits for the prefill
    server's KV, which never comes; then the prefill server is killed. Returns the decode server's answer, its used
    tokens while it waited and once they are freed, and the seconds to the abort and to the release; then starts a
    new prefill server on the same bootstrap port."""
    body = pair.body(prompt, NEW_TOKENS)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(requests.post, pair.decode.url + "/generate", json=body, timeout=600)
        try:
            waiting = ph.wait_until(
                lambda: (lambda x: x if x["disaggregation"]["decode_transfer_queue_reqs"] else None)(
                    ph.loads(pair.decode.url)
                ),
                120,
                "the request's pages pre-allocated on the decode server",
                poll=0.5,
            )
        finally:  # the request ends only when its prefill peer is gone
            t0 = time.time()
            pair.prefill.stop()
        r = fut.result()
        abort_s = time.time() - t0
    # SGLang keeps an aborted request's pages until the prefill side acks the drain, or 30 s without an ack
    freed = ph.wait_until(
        lambda: (lambda x: x if x["num_used_tokens"] == idle and x["num_running_reqs"] == 0 else None)(
            ph.loads(pair.decode.url)
        ),
        180,
        f"the decode pool back to its idle {idle} used tokens",
    )
    release_s = time.time() - t0
    assert requests.get(pair.decode.url + "/health", timeout=60).status_code == 200
    pair.start_prefill()
    return {
        "status": r.status_code,
        "error": r.text[:400],
        "used_while_waiting": waiting["num_used_tokens"],
        "abort_s": round(abort_s, 1),
        "release_s": round(release_s, 1),
        "used_after_abort": freed["num_used_tokens"],
    }


@pytest.mark.slow
@needs_router
def test_the_router_gives_a_single_servers_tokens(single, pd_pair, pd_router):
    """SGLang's router (`python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP_PORT
    --decode URL`) in front of the pair, ECHO off: greedy requests through its `/generate` (token ids, 19 / 300 /
    700 tokens, at once) and its OpenAI `/v1/completions` (text prompts, one past the 128-token window) give a
    single server's tokens, and the decode pool returns to its idle usage."""
    from sglang_ernie55.configuration import tiny_config

    pair, router = pd_pair, pd_router
    picks = (0, 4, 6)
    idle = ph.loads(pair.decode.url)["num_used_tokens"]
    t0 = time.time()
    with ThreadPoolExecutor(len(picks)) as ex:
        gen = list(ex.map(lambda i: _generate(router.url, single["prompts"][i]), picks))
    texts = [_complete(router.url, pair.decode.model, t) for t in ROUTER_TEXTS]
    serve_s = time.time() - t0
    idle_again_s = _idle(pair.decode.url, idle, 120, "after the router's requests")
    want = [single["outs"][i] for i in picks] + single["texts"]
    got = gen + texts
    same = sum(a == b for o, x in zip(got, want) for a, b in zip(o["tokens"], x["tokens"]))
    lp_diff = max(abs(a - b) for o, x in zip(got, want) for a, b in zip(o["logprobs"], x["logprobs"]))
    report = {
        "router_startup_s": round(router.startup_s, 1),
        "serve_s": round(serve_s, 1),
        "tokens_equal_to_single": f"{same}/{len(want) * NEW_TOKENS}",
        "max_logprob_diff_to_single": lp_diff,
        "text_prompt_tokens": [t["prompt_tokens"] for t in texts],
        "idle_again_s": round(idle_again_s, 1),
    }
    print(f"\n[pd cpu router] {report}")
    sh.write_report("pd_cpu_router", report)
    assert texts[1]["prompt_tokens"] > tiny_config().window_size, report
    assert [t["prompt_tokens"] for t in texts] == [t["prompt_tokens"] for t in single["texts"]], report
    assert same == len(want) * NEW_TOKENS, (report, router.tail())
    # served together through the router, alone or together on the single server
    assert lp_diff <= BATCHED_LP_TOL, report


def _post_generate(url: str, prompt: list[int], max_new_tokens: int) -> requests.Response:
    body = dict(
        input_ids=prompt,
        sampling_params=dict(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
        return_logprob=True,
    )
    return requests.post(url + "/generate", json=body, timeout=900)


def _chunks_sent(log_path, since: int) -> list[str]:
    """The prefill server's full 512-token prefill batches logged after line `since`."""
    lines = log_path.read_text(errors="replace").splitlines()[since:]
    return [ln for ln in lines if "Prefill batch" in ln and "#new-token: 512," in ln]


def _mooncake_mb_per_s(log_path, since: int) -> list[float]:
    """The throughputs Mooncake's transfer engine logged after line `since` (`MC_TE_METRIC=1`, one line per
    second that moved bytes)."""
    lines = log_path.read_text(errors="replace").splitlines()[since:]
    return [float(m[1]) for ln in lines if (m := re.search(r"\[Metrics\].*Throughput: ([\d.]+) MB/s", ln))]


@pytest.mark.slow
@needs_router
def test_a_prefill_server_killed_mid_transfer_behind_the_router(single, pd_pair, pd_router):
    """Behind the router, the prefill server is SIGKILLed while three 2000-token requests are in flight: the first
    one's KV is on its way (its prompt is prefilled and sent in 512-token chunks; the kill comes when the prefill
    server logs its third chunk, so its first chunk's pages were sent, as Mooncake's logged throughput shows, and its
    last chunk's never are), the other two wait on the decode server, their pages pre-allocated or queued for (the
    8192-token pool holds the pages and decode reserve of two). Meanwhile a request whose KV had already arrived is
    decoding. The decode server answers the three with HTTP 500 naming the lost prefill peer (the router passes it
    through), finishes the decoding one with a single server's tokens, frees every page (the pool back at its idle
    usage), and with a new prefill server on the same ports serves a single server's tokens through the router."""
    from sglang_ernie55.configuration import tiny_config

    pair, router = pd_pair, pd_router
    url = pair.decode.url
    prompts = single["prompts"]
    long_prompts = _prompts(tiny_config(), (LONG,) * 3, seed=3)
    idle = ph.loads(url)["num_used_tokens"]
    with ThreadPoolExecutor(4) as ex:
        decoding = ex.submit(_post_generate, router.url, prompts[1], KEEPS_DECODING_TOKENS)
        ph.wait_until(
            lambda: ph.loads(url)["num_running_reqs"] >= 1, 600, "the first request decoding", poll=0.2
        )
        time.sleep(1.5)  # Mooncake's per-second line of its transfer is written before `since`
        since = len(pair.prefill.log_path.read_text(errors="replace").splitlines())
        inflight = [ex.submit(_post_generate, router.url, p, NEW_TOKENS) for p in long_prompts]
        ph.wait_until(
            lambda: len(_chunks_sent(pair.prefill.log_path, since)) >= 3, 600, "a third chunk", poll=0.1
        )
        at_kill = ph.loads(url)
        t_kill = pair.kill_prefill()
        answers = [f.result() for f in inflight]
        abort_s = time.time() - t_kill
        kept = decoding.result()
    killed_log = pair.prefill.log_path  # a restarted prefill server logs to its own file
    chunks = _chunks_sent(killed_log, since)
    sent_mb_s = _mooncake_mb_per_s(killed_log, since)
    _idle(url, idle, 180, "after the prefill server died")
    release_s = time.time() - t_kill
    after = ph.loads(url)
    t0 = time.time()
    pair.start_prefill()
    restart_s = time.time() - t0
    again = _generate(router.url, prompts[3])
    idle_again_s = _idle(url, idle, 120, "after the request to the new prefill server")
    # "Decode transfer failed" (KV on its way or awaited) / "Decode handshake failed" (pages still queued for)
    errors = [
        f"{r.status_code} "
        + " ".join(re.findall(r"Decode \w+ failed|Lost connection with prefill instance", r.text))
        for r in answers
    ]
    report = {
        "running_at_kill": at_kill["num_running_reqs"],
        "transfer_queue_at_kill": at_kill["disaggregation"]["decode_transfer_queue_reqs"],
        "used_tokens_at_kill": at_kill["num_used_tokens"],
        "prealloc_queue_at_kill": at_kill["disaggregation"]["decode_prealloc_queue_reqs"],
        "chunks_logged_before_kill": len(chunks),
        "mooncake_mb_per_s_before_kill": sent_mb_s,
        "answers": errors,
        "abort_s": round(abort_s, 1),
        "decoding_one_equal_to_single": kept.status_code == 200
        and kept.json()["output_ids"] == single["keeps_decoding"]["tokens"],
        "release_s": round(release_s, 1),
        "used_after_release": after["num_used_tokens"],
        "idle_used_tokens": idle,
        "prefill_restart_s": round(restart_s),
        "again_equal_to_single": again["tokens"] == single["outs"][3]["tokens"],
        "idle_again_s": round(idle_again_s, 1),
    }
    print(f"\n[pd cpu prefill killed mid-transfer] {report}")
    sh.write_report("pd_cpu_prefill_killed", report)
    assert at_kill["num_running_reqs"] >= 1, ("the decoding request ended before the kill", report)
    # the first long request between the prefill server and the decode pool, the rest waiting on the decode server
    # (its pages pre-allocated, or in the queue for them)
    queues = at_kill["disaggregation"]
    assert queues["decode_transfer_queue_reqs"] >= 1, report
    assert queues["decode_transfer_queue_reqs"] + queues["decode_prealloc_queue_reqs"] == 3, report
    assert at_kill["num_used_tokens"] >= idle + LONG, report
    assert sent_mb_s and all(x > 0 for x in sent_mb_s), ("no KV bytes moved before the kill", report)
    assert all(r.status_code == 500 and "Lost connection with prefill instance" in r.text for r in answers), (
        report
    )
    assert report["decoding_one_equal_to_single"], (report, kept.text[:500])
    assert after["num_used_tokens"] == idle, report
    assert report["again_equal_to_single"], report
