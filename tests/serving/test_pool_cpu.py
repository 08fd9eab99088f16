"""Pool sizing arithmetic (through SGLang's real argument resolution and configurator hook), the SWA window
addressing over SGLang's own SWATokenToKVPoolAllocator, and the stored rows of `Ernie55TokenToKVPool`
(helper-4's byte layouts)."""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import SERVING_PAGE_SIZE, Ernie55Config, tiny_config
from sglang_ernie55.kernels.layout import hca_geometry, idx_geometry, mla_geometry
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool, PackedRows
from sglang_ernie55.mem_cache.sizing import (
    Buffer,
    fit_full_tokens,
    kv_bytes,
    normalize_kv_dtype,
    swa_tokens_for,
)
from tests.serving import sizing_harness as sh

PAGE = SERVING_PAGE_SIZE


def test_full_size_bytes_per_token():
    b = kv_bytes(Ernie55Config(), "fp8_e4m3")
    assert (b.n_hca, b.n_mla) == (37, 6)
    # SGLang's V4 layout: 149,760 B per 256-token page (585 B/token), compressed 864 B/entry;
    # FlashMLA V3.2 latent 656 B/token; indexer 132 B/token.
    assert b.window_row == 149_760 / 256 and b.cmp_row == 1_728 / 2
    assert (b.latent_row, b.index_row) == (656, 132)
    per = b.per_full_token(1.0)
    assert per == pytest.approx(37 * (585 + 864 / 128) + 6 * (656 + 132))  # 26.6 KB: window rows per token
    at_01 = b.per_full_token(0.1)
    assert at_01 == pytest.approx(37 * (0.1 * 585 + 864 / 128) + 6 * (656 + 132))  # 7.14 KB with the SWA pool
    assert at_01 < per / 3.7
    echo = kv_bytes(Ernie55Config(), "fp8_e4m3", echo=True)  # + the ECHO draft's window row per SWA token
    assert echo.per_full_token(0.1) - at_01 == pytest.approx(0.1 * 585)


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("swa_pages", [None, 2])
def test_pool_allocation_matches_sizing(kv, swa_pages, blocks):
    """The pool allocates exactly `KVBytes.allocated`: window rows at the SWA pool's size (+ padding page)
    in hybrid mode, at every full slot without an SWA pool; everything else at the full pool's size; the
    open-block state ring of 1 or 2 blocks (speculative decoding)."""
    cfg = tiny_config()
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    size, slots = 4 * PAGE, 5
    swa = None if swa_pages is None else swa_pages * PAGE
    pool = Ernie55TokenToKVPool(
        size, PAGE, dtype, cfg, num_req_slots=slots, device="cpu", swa_size=swa, state_blocks=blocks
    )
    assert pool.state_ring == blocks * cfg.compress_ratio
    assert all(
        st.shape == (slots + 1, blocks * cfg.compress_ratio, 2 * cfg.head_dim) for st in pool.state.values()
    )
    b = kv_bytes(cfg, kv, state_blocks=blocks)
    rows = size + PAGE
    cmp_pages = -(-(rows // 128 + 1) // 2)
    win_rows = (swa or size) + PAGE
    want = (
        win_rows * b.n_hca * b.window_row
        + rows * b.n_mla * (b.latent_row + b.index_row)
        + cmp_pages * 2 * b.n_hca * b.cmp_row
        + (slots + 1) * b.state_per_slot
    )
    assert pool.get_kv_size_bytes() == want == b.allocated(size, swa, slots)
    assert pool.window_rows == win_rows and pool.is_hybrid_swa == (swa is not None)
    assert all(w.rows == win_rows for w in pool.win.values())
    assert pool.cmp_scratch == pool.cmp_rows - 1 >= rows // 128


def test_speculative_sizing_reserves_the_draft_and_the_second_state_block():
    """Under EAGLE (ECHO) each SWA token also holds the draft pool's row (the full model: the V4 window
    layout, 585 B/token in fp8), and the fixed state per request slot doubles (the two-block ring)."""
    from sglang_ernie55.mem_cache.draft_pool import echo_bytes_per_token

    full = Ernie55Config()
    plain, spec = kv_bytes(full, "fp8_e4m3"), kv_bytes(full, "fp8_e4m3", echo=True, state_blocks=2)
    assert spec.draft_row == echo_bytes_per_token(full, torch.float8_e4m3fn) == 149_760 / 256
    assert spec.per_swa_token() == pytest.approx(plain.per_swa_token() + 149_760 / 256)
    assert spec.state_per_slot == 2 * plain.state_per_slot == 2 * 37 * 128 * 2 * 512 * 4
    with pytest.raises(ValueError, match="1 or 2"):
        Ernie55TokenToKVPool(
            256, 256, torch.bfloat16, tiny_config(), num_req_slots=1, device="cpu", state_blocks=3
        )


def test_fit_full_tokens_is_the_largest_page_count_within_budget():
    """The configurator's search: the largest page-aligned token count whose cost fits, for a cost with a
    fixed part (request table, state) and a per-token part, as the pool's own byte formula has."""
    b = kv_bytes(tiny_config(), "fp8_e4m3")
    budget = 3 * 2**30
    cost = lambda n: b.allocated(n, None, 64) + 5 * 2**20  # noqa: E731
    n = fit_full_tokens(budget, cost, 256)
    assert n % 256 == 0 and n > 0
    assert cost(n) <= budget < cost(n + 256)
    assert fit_full_tokens(cost(0) - 1, cost, 256) == 0


def test_kv_dtype_names():
    assert normalize_kv_dtype("torch.float8_e4m3fn") == "fp8_e4m3"
    assert normalize_kv_dtype("bf16") == "bfloat16"
    with pytest.raises(ValueError, match="fp8_e4m3 or bfloat16"):
        normalize_kv_dtype("fp8_e5m2")


@pytest.mark.parametrize(
    "geom,width,tile",
    [
        (hca_geometry("fp8_e4m3", 128, 64, 256), 128, 64),
        (mla_geometry("fp8_e4m3", 128, 64, 256), 192, 128),
        (idx_geometry("fp8_e4m3", 64, 256), 64, 64),
        (hca_geometry("bfloat16", 128, 64, 256), 128, None),
    ],
)
def test_packed_rows_roundtrip(geom, width, tile):
    """Rows go through the pool's byte layout: bf16 exact, fp8 within one e4m3 step of the tile scale,
    rope tails exact in bf16, other slots untouched."""
    g = torch.Generator().manual_seed(0)
    rows = PackedRows(Buffer("test", 0, 3 * 256, geom=geom), "cpu")
    x = torch.randn(5, width, generator=g) * torch.tensor([0.01, 1, 30, 300, 1e-3])[:, None]
    loc = torch.tensor([3, 300, 1, 767, 256])
    other = torch.randn(1, width, generator=g)
    rows.write(torch.tensor([4]), other)
    before = rows.read(torch.tensor([4]))
    rows.write(loc, x)
    y = rows.read(loc.view(5, 1)).view(5, width)
    assert torch.equal(rows.read(torch.tensor([4])), before)
    if tile is None:
        assert torch.equal(y, x.bfloat16().float())
        return
    rope = width - (geom.nope if geom.layout.value.startswith("hca") else geom.dim)
    if rope:
        assert torch.equal(y[:, -rope:], x[:, -rope:].bfloat16().float())
    q = width - rope
    xt, yt = x[:, :q].view(5, -1, tile), y[:, :q].view(5, -1, tile)
    amax = xt.abs().amax(-1, keepdim=True)
    assert ((yt - xt).abs() <= amax * 2**-3 + 1e-12).all()


# ------------------------------------------------------------------ SWA window addressing
def _swa_pool(full_pages=8, swa_pages=4, dtype=torch.bfloat16):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    pool = Ernie55TokenToKVPool(
        full_pages * PAGE,
        PAGE,
        dtype,
        tiny_config(),
        num_req_slots=4,
        device="cpu",
        swa_size=swa_pages * PAGE,
    )
    alloc = SWATokenToKVPoolAllocator(
        full_pages * PAGE, swa_pages * PAGE, PAGE, dtype, "cpu", pool, need_sort=False
    )
    return pool, alloc


def test_window_loc_is_the_allocators_mapping_and_pages_keep_offsets():
    """SGLang's SWATokenToKVPoolAllocator registers its mapping with the pool; over a random life of requests
    (chunked extends, decodes, out-of-window SWA frees, releases, reuse of freed pages) every live full slot
    keeps its offset inside its SWA page, all slots of one full page share one SWA page (so the page-table
    translation `window_pages` is exact), no two live full pages share an SWA page, and freed slots map to
    the padding page."""
    pool, alloc = _swa_pool(full_pages=16, swa_pages=6)
    assert pool.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping  # by reference: updated in place
    g = torch.Generator().manual_seed(0)
    lens, evicted = [0] * 4, [0] * 4
    r2t = torch.zeros(4, 8192, dtype=torch.int64)
    diverged, counts = False, {"evict": 0, "release": 0, "alloc": 0}

    def evict(q):  # SGLang's out-of-window rule (mem_cache/common.py free_swa_out_of_window_slots)
        new = max(evicted[q], (lens[q] - PAGE) // PAGE * PAGE)
        if new > evicted[q]:
            alloc.free_swa_segment(r2t[q, evicted[q] : new], start_pos=evicted[q])
            evicted[q] = new
            counts["evict"] += 1

    def release(q):  # finish / abort / retract: full pages, and the SWA pages not evicted yet
        if evicted[q]:
            alloc.free_full(r2t[q, : evicted[q]])
        alloc.free(r2t[q, evicted[q] : lens[q]])
        lens[q] = evicted[q] = 0
        counts["release"] += 1

    for step in range(300):
        r = int(torch.randint(0, 4, (1,), generator=g))
        op = int(torch.randint(0, 12, (1,), generator=g))
        P = lens[r]
        if op == 0 and P:
            release(r)
            continue
        if op == 1:
            evict(r)
            continue
        n = 1 if op < 7 else int(torch.randint(1, 200, (1,), generator=g))
        last = r2t[r, P - 1 : P] if P else torch.tensor([-1])
        pre, seq = torch.tensor([P]), torch.tensor([P + n])
        loc = (
            alloc.alloc_decode(seq, seq, last)
            if n == 1 and P
            else alloc.alloc_extend(pre, pre, seq, seq, last, n)
        )
        if loc is None:  # out of pages: the scheduler would evict windows, then retract the longest request
            for q in range(4):
                evict(q)
            release(max(range(4), key=lambda q: lens[q]))
            continue
        counts["alloc"] += 1
        r2t[r, P : P + n] = loc
        lens[r] = P + n
        m = pool.full_to_swa_index_mapping[:-1]
        f = torch.nonzero(m > 0)[:, 0]
        assert torch.equal(m[f] % PAGE, f % PAGE), step
        assert torch.equal(pool.window_pages(f // PAGE) * PAGE + f % PAGE, m[f]), step
        pages = torch.unique(f // PAGE)
        assert torch.unique(pool.window_pages(pages)).numel() == pages.numel(), step
        for q in range(4):  # every request's live window rows are mapped, evicted ones unmapped
            w = pool.window_loc(r2t[q, evicted[q] : lens[q]])
            assert (w >= PAGE).all(), (step, q)
            assert (pool.window_loc(r2t[q, : evicted[q]]) == 0).all(), (step, q)
            diverged |= bool((w != r2t[q, evicted[q] : lens[q]]).any())
    assert diverged and counts["evict"] >= 5 and counts["release"] >= 20, counts  # SWA slots != full slots
    # the kernels' page-table index rows (kernels/hca_meta.py) over window_pages = the SWA slots
    from sglang_ernie55.kernels.hca_meta import hca_indices

    live = [q for q in range(4) if lens[q]]
    full_pages = torch.zeros(4, 32, dtype=torch.int32)
    for q in live:
        n = -(-lens[q] // PAGE)
        full_pages[q, :n] = (r2t[q, 0 : n * PAGE : PAGE] // PAGE).to(torch.int32)
    q_req = torch.tensor([q for q in live for _ in range(3)])
    q_pos = torch.tensor([p for q in live for p in (lens[q] - 1, max(0, lens[q] - 130), lens[q] // 2)])
    win, win_len, _, _ = hca_indices(pool.window_pages(full_pages), full_pages, q_req, q_pos, cmp_width=64)
    for t in range(q_req.numel()):
        p = int(q_pos[t])
        positions = torch.arange(max(0, p - 127), p + 1)
        if positions[0] < evicted[int(q_req[t])]:
            continue  # out of the live window (SGLang never matches / decodes there)
        want = pool.window_loc(r2t[int(q_req[t]), positions])
        assert int(win_len[t]) == positions.numel() and torch.equal(win[t, : positions.numel()].long(), want)
    assert pool.window_loc(torch.tensor([-1, 0])).tolist() == [-1, 0]  # "no key" and the padding page
    assert pool.window_pages(torch.tensor([[-1, 0]])).tolist() == [[-1, 0]]


def test_window_addressing_errors_and_identity():
    cfg = tiny_config()
    plain = Ernie55TokenToKVPool(2 * PAGE, PAGE, torch.bfloat16, cfg, num_req_slots=2, device="cpu")
    loc = torch.tensor([[3, 700], [-1, 256]])
    assert plain.window_loc(loc) is loc and plain.window_pages(loc) is loc
    with pytest.raises(ValueError, match="without an SWA pool"):
        plain.register_mapping(torch.zeros(2 * PAGE + PAGE + 1, dtype=torch.int64))
    pool = Ernie55TokenToKVPool(
        2 * PAGE, PAGE, torch.bfloat16, cfg, num_req_slots=2, device="cpu", swa_size=PAGE
    )
    with pytest.raises(RuntimeError, match="no full->SWA mapping yet"):
        pool.window_loc(loc)
    with pytest.raises(ValueError, match=r"int64 \[full size \+ page_size \+ 1\] = \[769\]"):
        pool.register_mapping(torch.zeros(768, dtype=torch.int64))
    with pytest.raises(ValueError, match="positive multiple of page_size 256"):
        Ernie55TokenToKVPool(2 * PAGE, PAGE, torch.bfloat16, cfg, num_req_slots=2, device="cpu", swa_size=100)
    with pytest.raises(NotImplementedError, match="get_kv_buffer"):
        pool.get_kv_buffer(0)
    # PD's SWA component: the window rows of each HCA layer, whole SWA pages (tests/serving/test_pd_cpu.py)
    assert len(pool.get_state_buf_infos()[0]) == sum(t == "hca" for t in cfg.layer_types)


# ------------------------------------------------------------------ sizing through SGLang's resolution
@pytest.fixture(scope="module")
def ernie_ckpt(tmp_path_factory) -> str:
    import json

    d = tmp_path_factory.mktemp("ernie55-config")
    (d / "config.json").write_text(json.dumps(tiny_config().to_config_json()))
    return str(d)


def _sizes_through_sglang(ckpt: str, *flags: str, budget: int = 64 * 2**20):
    """`sglang serve` argument resolution -> SGLang's ModelConfig (its hybrid-SWA decision) -> SGLang's
    create_memory_pool_configurator (our hook) -> pool sizes for `budget` bytes -> what SGLang builds."""
    b = sh.build_like_sglang(
        ckpt, "--max-running-requests", "16", "--context-length", "2048", *flags, budget=budget
    )
    return b.model_config, b.conf, b.sizes, b.pool, b.server_args, b.planned


LONG = ("--context-length", "131072")


@pytest.mark.parametrize(
    "flags",
    [
        LONG,
        (*LONG, "--kv-cache-dtype", "bfloat16"),
        (*LONG, "--disable-hybrid-swa-memory"),
        (*LONG, "--speculative-algorithm", "EAGLE"),
        ("--context-length", "4096"),
    ],
)
def test_sglang_set_up_allocates_what_was_planned_within_budget(ernie_ckpt, flags):
    """No --max-running-requests (SGLang picks it from the pool size): the bytes SGLang's own set-up allocates
    for the sizes our configurator returned (request-to-token table, our pool, its allocator, the ECHO draft
    pool) equal the plan, and the plan fits the budget."""
    budget = 3 * 2**30
    b = sh.build_like_sglang(ernie_ckpt, *flags, budget=budget)
    plan = b.planned
    assert b.allocated == plan["pool"] + plan["req_to_token"] + plan["allocator"], (b.allocated, plan)
    assert sum(plan.values()) <= budget
    assert b.sizes.max_total_num_tokens > 0
    rows, cols = b.req_to_token.req_to_token.shape
    if "EAGLE" in flags:
        assert (
            rows - 1 == b.server_args.resolved_dict()["max_running_requests"]
        )  # SGLang's speculative default
    else:
        assert rows > 2048  # SGLang's own request count for a pool of this size
    assert cols > int(flags[1])  # the context length + SGLang's headroom


def test_budget_eaten_by_the_request_table_is_refused_by_name(ernie_ckpt):
    """A 1M-token context with SGLang's default request count: the request table alone exceeds a 3 GiB budget;
    the error names it and the flags that fix it (not SGLang's SWA-ratio or memory-fraction advice)."""
    with pytest.raises(RuntimeError, match=r"request-to-token table .* Lower --context-length"):
        sh.build_like_sglang(ernie_ckpt, "--context-length", "1048576", budget=3 * 2**30)


def test_swa_ratio_sizes_the_pool_through_sglang(ernie_ckpt, caplog):
    """`--swa-full-tokens-ratio` as SGLang resolves it (default 0.1 from the model's overrides; 1.0 given;
    `--disable-hybrid-swa-memory`): SGLang's ModelConfig runs the model as hybrid SWA (HCA layers = SWA
    layers), our configurator splits the same byte budget into full + SWA tokens at that ratio and logs
    them, and the pool built from those sizes allocates exactly the configurator's bytes, within budget."""
    import logging

    budget = 64 * 2**20
    caplog.set_level(logging.INFO, logger="sglang_ernie55.mem_cache.sizing")
    got = {}
    for name, flags in {
        "default": (),
        "1.0": ("--swa-full-tokens-ratio", "1.0"),
        "off": ("--disable-hybrid-swa-memory",),
    }.items():
        mc, conf, sizes, pool, _, planned = _sizes_through_sglang(ernie_ckpt, *flags, budget=budget)
        got[name] = (sizes.max_total_num_tokens, sizes.swa_max_total_num_tokens, pool)
        assert type(conf).__name__ == "Ernie55PoolConfigurator"
        assert pool.get_kv_size_bytes() == conf.layout.allocated(
            sizes.max_total_num_tokens, sizes.swa_max_total_num_tokens, pool.num_req_slots
        )
        assert sum(planned.values()) <= budget
        if name != "off":
            assert mc.is_hybrid_swa and mc.sliding_window_size == 128
            assert mc.swa_attention_layer_ids == mc.hf_config.hca_layer_ids == [0, 2, 3]
            assert mc.full_attention_layer_ids == mc.hf_config.mla_dsa_layer_ids == [1]
    (f01, s01, p01), (f1, s1, p1), (foff, soff, poff) = got["default"], got["1.0"], got["off"]
    assert s01 == swa_tokens_for(f01, 0.1, PAGE) and s1 == f1 and soff is None
    assert f01 > 2 * f1  # the same bytes hold > 2x the tokens at ratio 0.1 (tiny config: 3 HCA, 1 MLA layer)
    # no SWA pool = window rows at every full slot: the bytes of ratio 1.0, less SGLang's SWA index map
    assert f1 <= foff <= 1.02 * f1 and poff.window_rows == foff + PAGE
    assert p01.window_rows == s01 + PAGE < p1.window_rows
    logged = caplog.text
    assert (
        f"mode=hybrid-swa (memory budget) full_tokens={f01} swa_tokens={s01} swa_full_tokens_ratio=0.1"
        in logged
    )
    assert f"full_tokens={f1} swa_tokens={s1} swa_full_tokens_ratio=1.0" in logged
    assert f"mode=full-only (memory budget) full_tokens={foff} swa_tokens=None" in logged


def test_too_small_swa_pool_is_refused_by_sglangs_rule(ernie_ckpt):
    """SGLang's `validate_swa_pool_size`: an SWA pool at or below window + page rows can never admit a
    request; the error names the flag."""
    with pytest.raises(ValueError, match="Increase --swa-full-tokens-ratio"):
        _sizes_through_sglang(ernie_ckpt, "--swa-full-tokens-ratio", "0.01", budget=2 * 2**20)


def test_sglang_builds_swa_allocator_and_registers_the_mapping_with_both_pools(ernie_ckpt):
    """SGLang's own KVCacheConfigurator methods (with the plugin's hooks): the target worker gets our pool
    sized full + SWA and SGLang's SWATokenToKVPoolAllocator around it (mapping registered); the ECHO draft
    worker gets its window-only pool on the same SWA size, and SGLang registers the target allocator's
    mapping with it (so the draft's rows follow the target's SWA slots)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.runtime_context import create_context, use_context

    from sglang_ernie55.configuration import ARCH_ECHO
    from sglang_ernie55.mem_cache.draft_pool import EchoDraftKVPool

    mc, conf, sizes, _, sa, _ = _sizes_through_sglang(ernie_ckpt)
    full, swa = sizes.max_total_num_tokens, sizes.swa_max_total_num_tokens
    psizes = SimpleNamespace(
        max_total_num_tokens=full, full_max_total_num_tokens=full, swa_max_total_num_tokens=swa
    )
    r2t = SimpleNamespace(req_to_token=torch.zeros(17, 2048, dtype=torch.int32))

    def kvc(cfg, draft):
        return SimpleNamespace(
            is_draft_worker=draft,
            model_config=SimpleNamespace(hf_config=cfg),
            pool_page_size=PAGE,
            kv_cache_dtype=torch.float8_e4m3fn,
            device="cpu",
            is_hybrid_swa=True,
            hybrid_gdn_config=None,
            kv_shard_size=1,
            is_hybrid_swa_mtp_draft=False,
            draft_swa_full_capacity=False,
        )

    with use_context(create_context(sa, role="test")):
        t = kvc(mc.hf_config, False)
        pool = KVCacheConfigurator._build_token_to_kv_pool(
            t, sizes=psizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=r2t
        )
        alloc = KVCacheConfigurator._build_token_to_kv_pool_allocator(
            t,
            sizes=psizes,
            token_to_kv_pool=pool,
            is_dsv4_model=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=None,
        )
        d = kvc(tiny_config(architectures=[ARCH_ECHO]), True)
        dpool = KVCacheConfigurator._build_token_to_kv_pool(
            d, sizes=psizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=r2t
        )
        again = KVCacheConfigurator._build_token_to_kv_pool_allocator(
            d,
            sizes=psizes,
            token_to_kv_pool=dpool,
            is_dsv4_model=False,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=alloc,
        )
    assert isinstance(pool, Ernie55TokenToKVPool) and isinstance(alloc, SWATokenToKVPoolAllocator)
    assert (alloc.size_full, alloc.size_swa) == (full, swa) and pool.window_rows == swa + PAGE
    assert pool.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    assert isinstance(dpool, EchoDraftKVPool) and again is alloc
    assert (
        dpool.token_rows == swa + PAGE and dpool.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    )
    pre, seq = torch.tensor([0]), torch.tensor([300])
    loc = alloc.alloc_extend(pre, pre, seq, seq, torch.tensor([-1]), 300)
    assert torch.equal(dpool.window_loc(loc), pool.window_loc(loc)) and (pool.window_loc(loc) >= PAGE).all()


@pytest.mark.parametrize(
    ("ratio", "warned"), [(None, True), ("0.125", False)], ids=["demo-3-pages", "4-pages"]
)
def test_swa_pool_too_small_for_a_prefix_hit_is_named(ernie_ckpt, caplog, ratio, warned):
    """An SWA pool that SGLang's admission can never fit a prefix hit into (the demo's CPU flags: 0.1 of 8192
    tokens = 3 pages; measured on a real server: a repeated prompt waits in the queue, 4 pages serve it) gets a
    warning naming the flags and the smallest pool that admits one."""
    import logging

    from sglang.srt.runtime_context import create_context, use_context

    from sglang_ernie55.mem_cache.sizing import swa_prefix_hit_floor

    caplog.set_level(logging.WARNING, logger="sglang_ernie55.mem_cache.sizing")
    flags = ("--max-total-tokens", "8192") + (("--swa-full-tokens-ratio", ratio) if ratio else ())
    b = sh.build_like_sglang(
        ernie_ckpt, "--max-running-requests", "4", "--context-length", "2048", *flags[2:], budget=64 * 2**20
    )
    caplog.clear()
    with use_context(create_context(b.server_args, role="test")):
        swa = b.conf.calculate_pool_sizes_from_max_tokens(8192, PAGE).swa_max_total_num_tokens
    assert swa == (768 if ratio is None else 1024)
    assert swa_prefix_hit_floor(128, PAGE) == 4 * PAGE
    said = [r.getMessage() for r in caplog.records if "never admits a prefix-cache hit" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert "--swa-full-tokens-ratio" in said[0] and ">= 1024" in said[0], said[0]
