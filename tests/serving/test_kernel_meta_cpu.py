"""The kernel path's selection (SGLANG_ERNIE55_ATTN_IMPL) and its per-forward metadata, on CPU without
running a kernel: the Triton kernels take every geometry of the geometry matrix (tests/serving/geometries.py),
the device-built compression jobs equal the host planner's (kernels/hca_compress.py `plan_compress_jobs`) at
the config's window and compress ratio, padded CUDA-graph rows write nothing live, window rows go through the
pool's window translation, the indexer's query chunks stay inside their logits budget."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_ernie55.attention import kernel_path as kp  # noqa: E402
from sglang_ernie55.configuration import (
    SERVING_PAGE_SIZE,
    tiny_config,  # noqa: E402
)
from tests.serving import twin_harness as th
from tests.serving.geometries import BY_NAME, VARIANTS

PAGE = SERVING_PAGE_SIZE


@pytest.fixture(scope="module", autouse=True)
def _dist():
    th.init_dist()


def _backend(
    kv=torch.bfloat16,
    impl="torch",
    pool_cls=None,
    slots=6,
    pages=12,
    max_ctx=2048,
    deterministic=None,
    cfg=None,
):
    from sglang_ernie55.attention.backend import Ernie55AttnBackend
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    cfg = cfg or tiny_config()
    pool = (pool_cls or Ernie55TokenToKVPool)(pages * PAGE, PAGE, kv, cfg, num_req_slots=slots, device="cpu")
    r2t = torch.zeros(slots, max_ctx, dtype=torch.int32)
    runner = SimpleNamespace(
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(hf_config=cfg),
        req_to_token_pool=SimpleNamespace(req_to_token=r2t),
    )
    return Ernie55AttnBackend(runner, impl=impl, deterministic=deterministic), r2t


def _kernel_path(be, r2t) -> kp.KernelPath:
    """The kernel path's metadata builders over the backend's pool (they run no kernel: CPU tensors are fine)."""
    return kp.KernelPath(be.pool, r2t, be.pool.config)


def _fill_pages(r2t, lens, seed=0):
    """Shuffled pages per request slot, as SGLang's paged allocator leaves req_to_token."""
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(r2t.shape[0] * (r2t.shape[1] // PAGE), generator=g) + 1).tolist()
    for r, n in enumerate(lens):
        for p0 in range(0, -(-n // PAGE) * PAGE, PAGE):
            pg = pages.pop()
            r2t[r, p0 : p0 + PAGE] = torch.arange(pg * PAGE, (pg + 1) * PAGE)


# ----------------------------------------------------------------------------- selection


def test_auto_on_cpu_is_the_twin(caplog):
    with caplog.at_level("INFO"):
        be, _ = _backend(impl="auto")
    from sglang_ernie55.attention.torch_path import TorchPath

    assert {k: c.impl for k, c in be.choice.items()} == {"hca": "torch", "mla_dsa": "torch"}
    assert isinstance(be.impls["hca"], TorchPath) and be.impls["hca"] is be.impls["mla_dsa"]
    lines = [r.getMessage() for r in caplog.records if "ernie55 attention backend" in r.getMessage()]
    assert (
        len(lines) == 2
        and "hca layers run on torch" in lines[0]
        and "mla_dsa layers run on torch" in lines[1]
    )


@pytest.mark.parametrize("impl", ["triton", "flashmla"])
def test_forced_kernels_without_a_gpu_fail_clearly(impl, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError,
        match=f"SGLANG_ERNIE55_ATTN_IMPL={impl}: cannot serve the hca layers: "
        r".*no CUDA device.*Legal values: auto, torch, triton, flashmla",
    ):
        _backend(impl=impl)


def test_forced_flashmla_names_the_geometry(monkeypatch):
    """Under the interpreter the Triton kernels fit the tiny geometry; FlashMLA never does (CUDA, fp8, 512)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be, _ = _backend(impl="triton")
    assert {c.impl for c in be.choice.values()} == {"triton"}
    assert isinstance(be.impls["hca"], kp.KernelPath) and be.impls["hca"] is be.impls["mla_dsa"]
    assert be.impls["hca"].flashmla == frozenset()
    with pytest.raises(ValueError, match="cannot serve the hca layers: FlashMLA runs on CUDA only"):
        _backend(impl="flashmla", kv=torch.float8_e4m3fn)


# every row of the geometry matrix in bf16 KV, and in fp8 KV where the fp8 layouts hold it
MATRIX_KV = [
    (v.name, kv) for v in VARIANTS for kv in ("bfloat16", "fp8_e4m3") if kv == "bfloat16" or not v.fp8_kv
]


@pytest.mark.parametrize("variant,kv", MATRIX_KV, ids=[f"{n}-{kv}" for n, kv in MATRIX_KV])
def test_triton_takes_every_geometry_of_the_matrix(variant, kv, monkeypatch):
    """Every row of the geometry matrix (other windows and compress ratios, widths that are not powers of two,
    layer patterns), in bf16 and, where the fp8 layouts hold it (kernels/layout.fp8_unfit), fp8 KV: the Triton
    kernels serve each layer kind (no reason from select.triton_unfit), so on CUDA the torch path serves only
    when forced. Under the interpreter here, as the CUDA check is the device's."""
    from sglang_ernie55.attention import select

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = BY_NAME[variant].config()
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    be, _ = _backend(kv=dtype, impl="triton", cfg=cfg)
    assert {c.impl for c in be.choice.values()} == {"triton"} and set(be.choice) == set(cfg.layer_types)
    for kind in set(cfg.layer_types):
        assert select.triton_unfit(kind, cfg, be.pool, cfg.layer_types.index(kind)) == ""


def test_dense_pool_refuses_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="dense fp32 rows"):
        _backend(kv=torch.float32, impl="triton")


def test_deterministic_inference_selects_fixed_splits(monkeypatch, caplog):
    """--enable-deterministic-inference: the Triton kernels with fixed key splits (interpreter here); the twin
    on CPU with a warning; a forced FlashMLA refused with the reason; the default mode keeps free splits."""
    from sglang_ernie55.attention.kernel_path import DETERMINISTIC_SPLIT_KEYS

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    be, _ = _backend(impl="triton", deterministic=True)
    assert {c.impl for c in be.choice.values()} == {"triton"}
    assert be.impls["hca"].split_keys == DETERMINISTIC_SPLIT_KEYS
    assert all("batch-invariant" in c.why for c in be.choice.values())
    be, _ = _backend(impl="triton", deterministic=False)
    assert be.impls["hca"].split_keys is None
    be, _ = _backend(impl="auto")  # outside a server: SGLang's runtime context is not published -> off
    assert not be.deterministic
    with caplog.at_level("WARNING"):
        be, _ = _backend(impl="auto", deterministic=True)  # CPU pool: the twin, said out loud
    assert {c.impl for c in be.choice.values()} == {"torch"}
    assert any("may still depend on the batch" in r.getMessage() for r in caplog.records)
    with pytest.raises(
        ValueError,
        match="SGLANG_ERNIE55_ATTN_IMPL=flashmla: --enable-deterministic-inference "
        "needs batch-invariant attention and FlashMLA's tile scheduler",
    ):
        _backend(impl="flashmla", kv=torch.float8_e4m3fn, deterministic=True)
    with pytest.raises(ValueError, match="cannot serve the hca layers: the pool holds dense fp32 rows"):
        _backend(kv=torch.float32, impl="triton", deterministic=True)


def test_env_variable(monkeypatch):
    from sglang_ernie55.envs import attn_impl

    monkeypatch.delenv("SGLANG_ERNIE55_ATTN_IMPL", raising=False)
    assert attn_impl() == "auto"
    monkeypatch.setenv("SGLANG_ERNIE55_ATTN_IMPL", " Triton ")
    assert attn_impl() == "triton"
    monkeypatch.setenv("SGLANG_ERNIE55_ATTN_IMPL", "cuda")
    with pytest.raises(ValueError, match="'cuda': legal values are auto, torch, triton, flashmla"):
        attn_impl()
    monkeypatch.setenv("SGLANG_ERNIE55_ATTN_IMPL", "auto")
    monkeypatch.setenv("SGLANG_ERNIE55_HCA_ATTN", "triton")
    with pytest.raises(ValueError, match="replaced by SGLANG_ERNIE55_ATTN_IMPL"):
        attn_impl()


def test_layer_kind_comes_from_the_config():
    """The backend serves a layer as config.layer_types[layer_id] says; inputs of the other kind are refused
    (before anything is written)."""
    from sglang_ernie55.attention.interface import HCAInputs, MLAInputs

    be, _ = _backend()
    kinds = be.pool.config.layer_types
    t = torch.zeros(1, 1)
    for kind, wrong in (("mla_dsa", HCAInputs(t, None, t)), ("hca", MLAInputs(t, t, t))):
        lid = kinds.index(kind)
        layer = SimpleNamespace(layer_id=lid, scaling=1.0, v_head_dim=1)
        with pytest.raises(
            TypeError, match=f"layer {lid} is a {kind} layer .*its inputs are {type(wrong).__name__}"
        ):
            be.forward_decode(t, t, t, layer, SimpleNamespace(), ernie_inputs=wrong)


# ----------------------------------------------------------------------------- metadata


def _extend_fb(r2t, reqs, prefix, ext):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    loc = torch.cat([r2t[r, p : p + e].long() for r, p, e in zip(reqs, prefix, ext)])
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        out_cache_loc=loc,
        req_pool_indices=torch.tensor(reqs),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
    )


def _job_set(jobs):
    rows = torch.stack(jobs, 1)
    return sorted(tuple(r) for r in rows.tolist() if r[4] >= 0)


# (geometry-matrix row, seeds): the tiny preset (window / ratio 128 / 128), window 64 / ratio 32, window 32 <
# ratio 128, window / ratio 64 / 64
OTHER_GEOMETRIES = ("odd_mla_dims", "w32_c128_hca_only", "w64_c64_r1")
JOB_CASES = [("tiny", s) for s in range(6)] + [(n, s) for n in OTHER_GEOMETRIES for s in range(2)]


@pytest.mark.parametrize("variant,seed", JOB_CASES, ids=[f"{n}-{s}" for n, s in JOB_CASES])
def test_extend_jobs_equal_the_host_planner(variant, seed):
    """Random mixed batches (fresh prefills, chunk continuations at any offset, prefix hits, decode rows):
    the device-built jobs are exactly plan_compress_jobs' (the kernels' own host planner), and the index rows
    follow the config's window and compress ratio."""
    from sglang_ernie55.kernels.hca_compress import plan_compress_jobs

    rnd = random.Random(seed)
    cfg = BY_NAME[variant].config()
    W, ratio = cfg.window_size, cfg.compress_ratio
    be, r2t = _backend(cfg=cfg)
    reqs = rnd.sample(range(6), rnd.randint(1, 5))
    prefix = [rnd.choice([0, 256, rnd.randint(0, 700)]) for _ in reqs]
    ext = [rnd.choice([1, rnd.randint(1, 600)]) for _ in reqs]
    lens = [0] * 6
    for r, p, e in zip(reqs, prefix, ext):
        lens[r] = p + e
    _fill_pages(r2t, lens, seed)
    m = _kernel_path(be, r2t).extend_meta(_extend_fb(r2t, reqs, prefix, ext))
    seq = [p + e for p, e in zip(prefix, ext)]
    cmp = lambda i, j: int(r2t[reqs[i], ratio * j]) // ratio  # noqa: E731
    want = _job_set(plan_compress_jobs(prefix, seq, reqs, cmp, ratio=ratio))
    assert _job_set(m.jobs) == want
    # token rows: positions, batch rows, state slots, sequence lengths
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)])
    assert m.tok_pos.tolist() == pos.tolist()
    rows = torch.cat([torch.full((e,), i) for i, e in enumerate(ext)])
    assert m.tok_req.tolist() == rows.tolist()
    assert m.st_req.tolist() == [reqs[i] for i in rows.tolist()]
    assert m.st_seq.tolist() == [seq[i] for i in rows.tolist()]
    # window / compressed rows: slots of the right positions, -1 after the lengths
    t = rnd.randrange(len(pos))
    r, p = reqs[int(rows[t])], int(pos[t])
    lo = max(0, p - W + 1)
    assert m.win_idx.shape[1] == W and m.win_len[t] == p - lo + 1
    assert m.win_idx[t, : p - lo + 1].tolist() == r2t[r, lo : p + 1].tolist()
    assert (m.win_idx[t, p - lo + 1 :] == -1).all()
    nb = (p + 1) // ratio
    assert m.cmp_len[t] == nb and m.cmp_idx.shape[1] % 64 == 0
    assert m.cmp_idx[t, :nb].tolist() == [cmp(int(rows[t]), j) for j in range(nb)]
    assert (m.cmp_idx[t, nb:] == -1).all()
    for t0, t1, width in m.mla_chunks:
        assert (t1 - t0) * width <= kp.INDEXER_LOGITS_BUDGET or t1 - t0 == 1
        assert width >= int(m.tok_pos[t0:t1].max()) + 1
    assert m.index_config == kp.LOGITS_EXTEND  # the indexer variant of extend rows


def _random_extend(seed, prefix_of, ext_of, rnd):
    """An extend batch of 1-4 of 6 request slots (prefix / extend lengths from the callables) over shuffled
    pages: (kernel path, req_to_token, forward batch, reqs, prefix, ext)."""
    be, r2t = _backend()
    reqs = rnd.sample(range(6), rnd.randint(1, 4))
    prefix = [prefix_of() for _ in reqs]
    ext = [ext_of() for _ in reqs]
    lens = [0] * 6
    for r, p, e in zip(reqs, prefix, ext):
        lens[r] = p + e
    _fill_pages(r2t, lens, seed)
    return _kernel_path(be, r2t), r2t, _extend_fb(r2t, reqs, prefix, ext), reqs, prefix, ext


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_dense_rows_map_every_position_to_its_slot(seed, monkeypatch):
    """FlashMLA sparse prefill's copy of the batch's latent rows: the top-k's position -> copy row through
    dense_pt lands on the copy row holding that position's full-pool slot (dense_loc), for every causal
    position of every request (shuffled pages, prefixes, several requests); -1 past each request's length; no
    copy for a batch past MLA_DENSE_ROWS, nor on a path without the sparse prefill."""
    rnd = random.Random(seed)
    prefix_of = lambda: rnd.choice([0, 256, rnd.randint(0, 700)])  # noqa: E731
    path, r2t, fb, reqs, prefix, ext = _random_extend(seed, prefix_of, lambda: rnd.randint(1, 600), rnd)
    assert path.extend_meta(fb).dense_loc is None  # no FlashMLA here
    path.mla_prefill = True
    m = path.extend_meta(fb)
    seq = [p + e for p, e in zip(prefix, ext)]
    assert m.dense_loc.shape == (sum(-(-L // PAGE) for L in seq) * PAGE,) and m.dense_loc.dtype == torch.int64
    assert m.dense_pt.dtype == torch.int32 and m.dense_pt.shape == m.page_table.shape
    covered = torch.zeros_like(m.dense_loc, dtype=torch.bool)
    for b, (r, L) in enumerate(zip(reqs, seq)):
        s = torch.arange(L)
        row = m.dense_pt[b, s // PAGE].long() * PAGE + s % PAGE
        assert m.dense_loc[row].tolist() == r2t[r, :L].tolist()
        covered[row] = True
    assert (m.dense_loc[~covered] == -1).all()
    assert kp.meta_difference(m, m) == "" and kp.meta_difference(m, path.extend_meta(fb)) == ""
    monkeypatch.setattr(kp, "MLA_DENSE_ROWS", sum(-(-L // PAGE) for L in seq) * PAGE - 1)
    assert path.extend_meta(fb).dense_loc is None
    assert kp.meta_difference(m, path.extend_meta(fb)) == "dense_loc"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_extend_hca_rows_select_each_querys_window_and_compressed_keys(seed):
    """FlashMLA sparse prefill of the HCA layers: each query's copy rows (hca_sel) hold exactly the
    window-pool slots of its win_idx row and the compressed-pool slots of its cmp_idx row (the decode kernel's
    keys), window first; -1 past them; every copy row is some query's (shuffled pages, prefixes inside and
    past the window and across compression blocks, several requests); no copy without the path's flag."""
    rnd = random.Random(seed)
    prefix_of = lambda: rnd.choice([0, 100, 256, rnd.randint(0, 900)])  # noqa: E731
    ext_of = lambda: rnd.choice([1, 127, rnd.randint(1, 700)])  # noqa: E731
    path, r2t, fb, reqs, prefix, ext = _random_extend(seed, prefix_of, ext_of, rnd)
    assert path.extend_meta(fb).hca_sel is None
    path.hca_prefill = True
    m = path.extend_meta(fb)
    W, Nw = path.W, m.hca_win_loc.shape[0]
    assert m.hca_sel.dtype == torch.int32 and m.hca_sel.shape == (sum(ext), W + m.cmp_idx.shape[1])
    assert m.hca_win_loc.dtype == m.hca_cmp_loc.dtype == torch.int64
    used = torch.zeros(Nw + m.hca_cmp_loc.shape[0], dtype=torch.bool)
    for t in range(sum(ext)):
        wl, cl = int(m.win_len[t]), int(m.cmp_len[t])
        sel = m.hca_sel[t].long()
        win, cmp, pad = sel[:W], sel[W:], torch.cat([sel[:W][wl:], sel[W:][cl:]])
        assert (pad == -1).all() and (win[:wl] < Nw).all() and (cmp[:cl] >= Nw).all()
        assert sorted(m.hca_win_loc[win[:wl]].tolist()) == sorted(m.win_idx[t, :wl].tolist())
        assert sorted(m.hca_cmp_loc[cmp[:cl] - Nw].tolist()) == sorted(m.cmp_idx[t, :cl].tolist())
        used[sel[sel >= 0]] = True
    assert used.all()
    assert kp.meta_difference(m, path.extend_meta(fb)) == ""


def test_decode_graph_rows_padded_rows_write_nothing():
    """A padded CUDA-graph row (request slot 0, out_cache_loc 0 in the padding page, seq len 128 so that
    it would complete a block) gets no compression job and no state row; the real rows do."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    be, r2t = _backend()
    _fill_pages(r2t, [300, 128, 500])
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor([1, 2, 0]),
        seq_lens=torch.tensor([128, 384, 128]),
        out_cache_loc=torch.stack([r2t[1, 127], r2t[2, 383], torch.tensor(0)]).long(),
    )
    m = _kernel_path(be, r2t).fixed_meta(fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, 1, be.max_ctx)
    assert m.st_req.tolist() == [1, 2, -1]
    assert _job_set(m.jobs) == [
        (1, 0, 127, 0, int(r2t[1, 0]) // 128),
        (2, 2, 383, 1, int(r2t[2, 256]) // 128),
    ]
    assert m.cmp_idx.shape == (3, -(-(2048 // 128) // 64) * 64) and m.mla_chunks == ((0, 3, 2048),)
    assert m.index_config == kp.LOGITS_DECODE


def test_window_rows_go_through_the_pools_translation():
    """A pool with `window_loc` (the SWA window pool): window writes and window index rows are translated,
    -1 stays -1; compressed rows, latent / indexer slots stay full-pool slots."""
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    class Shifted(Ernie55TokenToKVPool):
        def window_loc(self, full):
            return full + 7

    be, r2t = _backend(pool_cls=Shifted)
    _fill_pages(r2t, [200])
    m = _kernel_path(be, r2t).extend_meta(_extend_fb(r2t, [0], [150], [50]))
    assert torch.equal(m.win_loc, m.loc + 7)
    assert m.win_idx[0, :128].tolist() == (r2t[0, 23:151] + 7).tolist()
    assert m.win_idx[-1].tolist() == (r2t[0, 72:200] + 7).tolist()
    assert m.cmp_idx[-1, 0] == int(r2t[0, 0]) // 128 and m.cmp_idx[-1, 1] == -1


def test_mla_chunks_budget(monkeypatch):
    monkeypatch.setattr(kp, "INDEXER_LOGITS_BUDGET", 1000)
    ext, seq = [5, 300, 1, 40], [5, 310, 400, 2000]
    ch = kp._mla_chunks(ext, seq)
    assert ch[0][0] == 0 and ch[-1][1] == sum(ext)
    assert all(a[1] == b[0] for a, b in zip(ch, ch[1:]))
    starts = [0, 5, 305, 306]
    for t0, t1, w in ch:
        assert (t1 - t0) * w <= 1000 or t1 - t0 == 1
        need = max(seq[i] for i, s in enumerate(starts) if s < t1 and s + ext[i] > t0)
        assert w == need


def test_graph_rows_chunk_the_indexer_at_the_context_width(monkeypatch):
    """Decode graphs are captured at the context width: the indexer's [rows, width] logits come in chunks
    within the budget (one [256, 1M] chunk took GiBs at capture), covering every row once."""
    monkeypatch.setattr(kp, "INDEXER_LOGITS_BUDGET", 4096)
    be, r2t = _backend()
    B, per_req = 7, 3
    req = torch.zeros(B, dtype=torch.int64)
    seq = torch.full((B,), 3)
    loc = torch.zeros(B * per_req, dtype=torch.int64)
    m = _kernel_path(be, r2t).fixed_meta(req, seq, loc, per_req, be.max_ctx)
    ch = m.mla_chunks
    assert len(ch) > 1 and ch[0][0] == 0 and ch[-1][1] == B * per_req
    assert all(a[1] == b[0] for a, b in zip(ch, ch[1:]))
    assert all((t1 - t0) * w <= 4096 and w == be.max_ctx for t0, t1, w in ch)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_fixed_rows_per_request_equal_the_extend_rows(k):
    """fixed_meta with k new tokens per request (decode: 1; a verify pass: steps + 1) builds the same rows,
    jobs and state targets as extend_meta of the same batch written as an extend."""
    be, r2t = _backend()
    reqs, seq = [3, 0, 5], [130, 384, 1000]
    lens = [0] * 6
    for r, n in zip(reqs, seq):
        lens[r] = n
    _fill_pages(r2t, lens, seed=k)
    prefix = [n - k for n in seq]
    path = _kernel_path(be, r2t)
    ext_m = path.extend_meta(_extend_fb(r2t, reqs, prefix, [k] * 3))
    loc = torch.cat([r2t[r, p : p + k].long() for r, p in zip(reqs, prefix)])
    fix_m = path.fixed_meta(torch.tensor(reqs), torch.tensor(seq), loc, k, 1000)
    for f in (
        "tok_req",
        "tok_pos",
        "loc",
        "win_loc",
        "win_idx",
        "win_len",
        "cmp_idx",
        "cmp_len",
        "st_req",
        "st_seq",
    ):
        assert torch.equal(getattr(fix_m, f).long(), getattr(ext_m, f).long()), f
    assert _job_set(fix_m.jobs) == _job_set(ext_m.jobs) and len(_job_set(fix_m.jobs)) == 1 + (
        k >= 3
    )  # 384; 128
