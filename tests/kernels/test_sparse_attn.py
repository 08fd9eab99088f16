"""sparse_mqa_attention (HCA window + compressed + sink; MLA-DSA absorbed) vs the reference over the
same pools; HCA decode and extend over ragged requests; FlashMLA on the same cache where it runs; and the
geometries a config may take beyond the full-size / tiny ones (other windows and compress ratios, widths that
are not powers of two: held padded inside the kernel)."""

import pytest
import torch

from sglang_ernie55.configuration import HCA_COMPRESS_RATIO, HCA_WINDOW
from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels import torch_twin
from sglang_ernie55.kernels.sparse_attn import Scope, flashmla_sparse_attention, sparse_mqa_attention
from sglang_ernie55.reference import functional as F
from sglang_ernie55.reference import kernels_ref as R
from tests.kernels.kutil import DEV, PagedRequests, filled_pool, poison, rel

TOL = {"fp8": 2e-2, "bf16": 2e-2}  # bf16 q / p operands and a bf16 output


def _hca_case(
    kv,
    seq_lens,
    queries_per_req,
    H,
    num_splits=None,
    dim=512,
    rope=64,
    check_mask_ref=False,
    window=HCA_WINDOW,
    ratio=HCA_COMPRESS_RATIO,
    **kw,
):
    torch.manual_seed(0)
    reqs = PagedRequests(seq_lens, window=window, ratio=ratio)
    g = L.hca_geometry(kv, dim=dim, rope=rope)
    gc = L.hca_geometry(kv, dim=dim, rope=rope, page_size=reqs.cmp_page_size)
    win_pool, win_x = filled_pool(g, reqs.num_pages, dim)
    cmp_pool, cmp_x = filled_pool(gc, reqs.num_pages, dim)
    queries = [(r, p) for r, L_ in enumerate(seq_lens) for p in range(max(0, L_ - queries_per_req), L_)]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries)
    T = len(queries)
    q = torch.randn(T, H, dim, device=DEV).to(torch.bfloat16)
    sink = torch.randn(H, device=DEV)
    out = poison((T, H, dim), torch.bfloat16)
    main, extra = Scope(win_pool, g, wi, wl), Scope(cmp_pool, gc, ci, cl)
    o, lse = sparse_mqa_attention(
        q, main, extra, sm_scale=dim**-0.5, d_v=dim, sink=sink, out=out, num_splits=num_splits, **kw
    )
    assert o.data_ptr() == out.data_ptr() and not torch.isnan(o).any()
    ref = R.sparse_attention(
        q.cpu(),
        [(win_pool.cpu(), g, wi.cpu(), wl.cpu()), (cmp_pool.cpu(), gc, ci.cpu(), cl.cpu())],
        sink.cpu(),
        dim**-0.5,
        dim,
    )
    assert rel(o.cpu(), ref) < TOL[kv], rel(o.cpu(), ref)
    if check_mask_ref:  # the index lists themselves against functional.hca_visible_mask, per request
        for r, Lr in enumerate(seq_lens):
            rows = [i for i, (rr, _) in enumerate(queries) if rr == r]
            qpos = torch.tensor([queries[i][1] for i in rows])
            kv_all = torch_twin.pool_gather(win_pool.cpu(), g, torch.tensor(reqs.token_slots(r, 0, Lr)))
            ncmp = Lr // ratio
            cmp_all = torch_twin.pool_gather(
                cmp_pool.cpu(), gc, torch.tensor([reqs.cmp_slot(r, j) for j in range(ncmp)], dtype=torch.long)
            )
            raw, cm = F.hca_visible_mask(qpos, torch.arange(Lr), ncmp, window, ratio)
            ref2 = F.sink_attention(
                q[rows].cpu(), torch.cat([kv_all, cmp_all]), torch.cat([raw, cm], 1), sink.cpu(), dim**-0.5
            )
            assert rel(o[rows].cpu(), ref2) < TOL[kv]
    return o, lse, (q, main, extra, sink)


# head-dim chunks of the split kernel: serving's default (128 dims, the padded width where that is narrower; on the
# HCA fp8 row (scale tile 64) two tiles per chunk, the last chunk fp8 and bf16 dims) and 64 / 256 dims (one scale
# tile per chunk; two MLA fp8 tiles per chunk, a chunk of three HCA fp8 tiles and the bf16 dims)
VAR = {
    "default": {},
    "dc64": dict(block_d=64),
    "dc256": dict(block_d=256),
}


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_hca_decode_tiny(kv, splits, var):
    # lengths around the window / block: 1, 127, 129, 257 (2 compressed entries); 4 heads (padded to 16)
    _hca_case(kv, [1, 127, 129, 257], 1, H=4, num_splits=splits, check_mask_ref=True, **VAR[var])


@pytest.mark.parametrize("var", ["default", "dc64"])
def test_hca_extend_tiny_dims(var):
    # tiny head dims (128 = 64 fp8 + 64 bf16 rope), a chunk of 3 queries per request; default: one chunk that
    # holds the fp8 and the bf16 dims of the row
    _hca_case("fp8", [19, 130], 3, H=2, dim=128, rope=64, num_splits=2, **VAR[var])


@pytest.mark.parametrize("var", ["dc256"])
def test_hca_decode_tiny_dchunk_mixed_chunk(var):
    # full width, chunks of 256: chunk 0 = 4 fp8 tiles, chunk 1 = 3 fp8 tiles + the 64 bf16 rope dims
    _hca_case("fp8", [129, 257], 1, H=4, num_splits=2, **VAR[var])


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("var", ["default", "dc64", "dc256"])
def test_mla_decode_tiny(kv, var):
    torch.manual_seed(1)
    g = L.mla_geometry(kv)
    reqs = PagedRequests([1, 97, 300])
    pool, _ = filled_pool(g, reqs.num_pages, 576)
    queries = [(0, 0), (1, 96), (2, 299)]
    idx, ln = reqs.mla_indices(queries)
    idx[2, 5] = -1  # a hole inside the list is skipped
    q = torch.randn(3, 16, 576, device=DEV).to(torch.bfloat16)
    o, _ = sparse_mqa_attention(
        q, Scope(pool, g, idx, ln), sm_scale=192**-0.5, d_v=512, num_splits=2, **VAR[var]
    )
    ref = R.sparse_attention(q.cpu(), [(pool.cpu(), g, idx.cpu(), ln.cpu())], None, 192**-0.5, 512)
    assert rel(o.cpu(), ref) < TOL[kv]


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("var", ["default"])
def test_mla_tiny_value_with_rope_tail(kv, var):
    """d_v = 576: the value includes the bf16 rope tail (its own accumulator), one split and several."""
    torch.manual_seed(5)
    g = L.mla_geometry(kv)
    reqs = PagedRequests([70, 200])
    pool, _ = filled_pool(g, reqs.num_pages, 576)
    idx, ln = reqs.mla_indices([(0, 69), (1, 199)])
    q = torch.randn(2, 16, 576, device=DEV).to(torch.bfloat16)
    ref = R.sparse_attention(q.cpu(), [(pool.cpu(), g, idx.cpu(), ln.cpu())], None, 192**-0.5, 576)
    for splits in (1, 3):
        o, _ = sparse_mqa_attention(
            q, Scope(pool, g, idx, ln), sm_scale=192**-0.5, d_v=576, num_splits=splits, **VAR[var]
        )
        assert rel(o.cpu(), ref) < TOL[kv], (splits, rel(o.cpu(), ref))


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_two_scopes_ragged_boundary(kv, var):
    """Main lengths that are not multiples of block_n, so a key block straddles the main / extra boundary (the
    split kernel reads both scopes in one loop), holes (-1) in both scopes, empty scopes, an empty query (out
    0), and splits that end inside either scope; HCA rows (dim 128) in two differently paged pools."""
    torch.manual_seed(6)
    g = L.hca_geometry(kv, dim=128, rope=64)
    gc = L.hca_geometry(kv, dim=128, rope=64, page_size=L.HCA_CMP_PER_PAGE)
    pa, _ = filled_pool(g, 3, 128)
    pb, _ = filled_pool(gc, 200, 128)
    la = [5, 37, 0, 70, 0]
    lb = [3, 0, 50, 64, 0]
    ia = torch.full((5, 96), -1, dtype=torch.int32)
    ib = torch.full((5, 64), -1, dtype=torch.int32)
    for t in range(5):
        ia[t, : la[t]] = torch.randperm(3 * 256)[: la[t]].to(torch.int32)
        ib[t, : lb[t]] = torch.randperm(400)[: lb[t]].to(torch.int32)
        ia[t, la[t] :] = 7  # valid-looking slots past the length
    ia[1, 3] = -1
    ib[2, 40] = -1
    wl, cl = torch.tensor(la, dtype=torch.int32), torch.tensor(lb, dtype=torch.int32)
    ia, ib, wl, cl = ia.to(DEV), ib.to(DEV), wl.to(DEV), cl.to(DEV)
    q = torch.randn(5, 4, 128, device=DEV).to(torch.bfloat16)
    sink = torch.randn(4, device=DEV)
    scopes = [(pa.cpu(), g, ia.cpu(), wl.cpu()), (pb.cpu(), gc, ib.cpu(), cl.cpu())]
    ref = R.sparse_attention(q.cpu(), scopes, sink.cpu(), 128**-0.5, 128)
    for kw in (dict(num_splits=1), dict(num_splits=3), dict(split_keys=32)):
        out = poison((5, 4, 128), torch.float32)
        o, lse = sparse_mqa_attention(
            q,
            Scope(pa, g, ia, wl),
            Scope(pb, gc, ib, cl),
            sm_scale=128**-0.5,
            d_v=128,
            sink=sink,
            out=out,
            **kw,
            **VAR[var],
        )
        assert not torch.isnan(o).any() and rel(o.cpu(), ref) < TOL[kv], (kw, rel(o.cpu(), ref))
        assert (o[4] == 0).all() and torch.isinf(lse[4]).all()


def test_block_d_checks():
    """block_d: a power of two >= 16 dividing the padded main width (512) into at most 8 chunks."""
    q, scopes, kw = _invariance_cases()["mla"]
    for bd in (32 + 16, 1024, 8, 32):
        with pytest.raises(ValueError, match="block_d"):
            sparse_mqa_attention(q, *scopes, block_d=bd, **kw)


def test_sparse_attn_rejects_bad_shapes():
    g = L.hca_geometry("bf16")
    pool = torch.zeros(1, g.page_bytes, dtype=torch.uint8)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="q: expected"):
        sparse_mqa_attention(
            torch.zeros(2, 4, 576, dtype=torch.bfloat16), Scope(pool, g, idx), sm_scale=1.0, d_v=512
        )
    with pytest.raises(ValueError, match="indices: int32"):
        sparse_mqa_attention(
            torch.zeros(2, 4, 512, dtype=torch.bfloat16), Scope(pool, g, idx.long()), sm_scale=1.0, d_v=512
        )


# ------------------------------------------------------------------ geometries beyond the full-size / tiny ones
# HCA (window, compress ratio, head_dim, rope, KV dtypes): window 64 / ratio 32 and window 32 / ratio 64 at head
# 96 / rope 32 (nope 64: one fp8 tile; rows held at 128 columns), head 112 / rope 32 (nope 80 is no whole fp8
# tile: bf16 only)
ODD_HCA = {
    "w64_c32_d96": (64, 32, 96, 32, ("fp8", "bf16")),
    "w32_c64_d96": (32, 64, 96, 32, ("bf16",)),
    "w128_c128_d112": (128, 128, 112, 32, ("bf16",)),
}
# MLA-DSA latent + rope: 96 + 32 (bf16: fp8 needs latent % 128), 384 + 24 (fp8 latent, a padded rope tail),
# 48 + 16 (d_v 48: the narrowest value width of the matrix)
ODD_MLA = {"r96_32": (96, 32, ("bf16",)), "r384_24": (384, 24, ("fp8",)), "r48_16": (48, 16, ("bf16",))}


def _odd(table):
    return [pytest.param(n, kv, id=f"{n}-{kv}") for n, (*_, kvs) in table.items() for kv in kvs]


@pytest.mark.parametrize("name,kv", _odd(ODD_HCA))
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_hca_odd_geometry(name, kv, var):
    """Window / compressed rows of another window and ratio, head widths that are not powers of two, 3 heads;
    decode and a 2-query extend per request, lengths around the window and block boundaries; against the index
    lists of functional.hca_visible_mask too."""
    window, ratio, dim, rope, _ = ODD_HCA[name]
    lens = sorted({1, ratio - 1, ratio + 1, window + 1, 2 * max(window, ratio) + 3})
    kw = dict(dim=dim, rope=rope, window=window, ratio=ratio, check_mask_ref=True, **VAR[var])
    _hca_case(kv, lens, 2, H=3, num_splits=2, **kw)


@pytest.mark.parametrize("name,kv", _odd(ODD_MLA))
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_mla_odd_geometry(name, kv, var):
    """Absorbed MLA over latent + rope rows that are not powers of two wide, 5 heads, a hole in an index row;
    d_v = the latent (o_latent) and latent + rope (the value's rope tail in its own accumulator); one split and
    several (the combine pass at the real d_v)."""
    lat, r, _ = ODD_MLA[name]
    torch.manual_seed(7)
    g = L.mla_geometry(kv, lat, r)
    reqs = PagedRequests([1, 40, 150])
    pool, _ = filled_pool(g, reqs.num_pages, lat + r)
    idx, ln = reqs.mla_indices([(0, 0), (1, 39), (2, 149)])
    idx[2, 5] = -1
    q = torch.randn(3, 5, lat + r, device=DEV).to(torch.bfloat16)
    scale = (lat + r) ** -0.5
    for d_v in (lat, lat + r):
        ref = R.sparse_attention(q.cpu(), [(pool.cpu(), g, idx.cpu(), ln.cpu())], None, scale, d_v)
        for splits in (1, 3):
            out = poison((3, 5, d_v), torch.float32)
            kw = dict(sm_scale=scale, d_v=d_v, num_splits=splits, out=out, **VAR[var])
            o, _ = sparse_mqa_attention(q, Scope(pool, g, idx, ln), **kw)
            assert not torch.isnan(o).any() and rel(o.cpu(), ref) < TOL[kv], (d_v, splits, rel(o.cpu(), ref))


@pytest.mark.parametrize("var", ["default", "dc64"])
def test_split_keys_batch_invariant_odd_geometry(var):
    """Fixed key splits stay batch invariant at a geometry whose rows are padded inside the kernel: HCA window 64
    / ratio 32 / head 96 (fp8) and MLA latent 96 + rope 32 (bf16), alone vs reordered in a batch with wider
    rows, bit-identical, and the right attention."""
    torch.manual_seed(8)
    reqs = PagedRequests([19, 70, 200], window=64, ratio=32)
    g, gc = L.hca_geometry("fp8", 96, 32), L.hca_geometry("fp8", 96, 32, page_size=reqs.cmp_page_size)
    win_pool, _ = filled_pool(g, reqs.num_pages, 96)
    cmp_pool, _ = filled_pool(gc, reqs.num_pages, 96)
    queries = [(r, p) for r, L_ in enumerate(reqs.seq_lens) for p in (L_ - 2, L_ - 1)]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries)
    gm = L.mla_geometry("bf16", 96, 32)
    mpool, _ = filled_pool(gm, reqs.num_pages, 128)
    idx, ln = reqs.mla_indices(queries)
    T = len(queries)
    hca_q = torch.randn(T, 3, 96, device=DEV).to(torch.bfloat16)
    hca_kw = dict(sm_scale=96**-0.5, d_v=96, sink=torch.randn(3, device=DEV))
    mla_q = torch.randn(T, 3, 128, device=DEV).to(torch.bfloat16)
    cases = [
        (hca_q, [Scope(win_pool, g, wi, wl), Scope(cmp_pool, gc, ci, cl)], hca_kw),
        (mla_q, [Scope(mpool, gm, idx, ln)], dict(sm_scale=128**-0.5, d_v=96)),
    ]
    for q, scopes, kw in cases:
        alone, batched = _run_in_batches(q, scopes, 64, **kw, **VAR[var])
        assert torch.equal(alone, batched), (alone - batched).abs().max().item()
        sink = kw.get("sink")
        sc = [(s.pool.cpu(), s.geom, s.indices.cpu(), s.lengths.cpu()) for s in scopes]
        ref = R.sparse_attention(
            q.cpu(), sc, sink.cpu() if sink is not None else None, kw["sm_scale"], kw["d_v"]
        )
        assert rel(alone.cpu(), ref) < TOL["fp8"], rel(alone.cpu(), ref)


# ----------------------------------------------------------------------------- full size (GPU)

RAGGED = [1, 19, 97, 127, 128, 129, 255, 256, 257, 511, 513, 3001]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"num_stages": 1},
        {"block_n": 64, "num_warps": 16},
        {"block_h": 16, "num_warps": 4},
        {"block_n": 16},
        {"block_d": 64, "block_n": 64},
        {"block_d": 64, "block_n": 32, "num_warps": 16},
    ],
)
def test_hca_decode_full(kv, cfg):
    _hca_case(kv, RAGGED, 1, H=64, check_mask_ref=True, **cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_hca_extend_full(kv, var):
    _hca_case(kv, [129, 300, 1000], 40, H=64, check_mask_ref=True, **VAR[var])


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_hca_decode_long(kv):
    _hca_case(kv, [20000, 4097], 1, H=64)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_hca_flashmla_same_cache(H):
    pytest.importorskip("flash_mla")
    o, _, (q, main, extra, sink) = _hca_case("fp8", RAGGED, 1, H=H)
    fo, _ = flashmla_sparse_attention(q, main, extra, sm_scale=512**-0.5, d_v=512, sink=sink)
    assert rel(fo.float(), o.float()) < 1e-2, rel(fo.float(), o.float())


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"num_stages": 1},
        {"block_n": 64, "num_warps": 16},
        {"block_d": 64, "block_n": 64},
        {"block_d": 256},
    ],
)
def test_mla_sparse_full(kv, cfg):
    torch.manual_seed(2)
    g = L.mla_geometry(kv)
    reqs = PagedRequests([1, 97, 2048, 2049, 5000])
    pool, _ = filled_pool(g, reqs.num_pages, 576)
    topk = 2048
    queries = [(r, s - 1) for r, s in enumerate(reqs.seq_lens)]
    rows = []
    for r, p in queries:
        sel = torch.randperm(p + 1)[:topk].tolist()
        rows.append([reqs.slot(r, s) for s in sel])
    idx = torch.full((len(rows), topk), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    ln = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    idx, ln = idx.to(DEV), ln.to(DEV)
    q = torch.randn(len(rows), 128, 576, device=DEV).to(torch.bfloat16)
    o, _ = sparse_mqa_attention(q, Scope(pool, g, idx, ln), sm_scale=192**-0.5, d_v=512, **cfg)
    ref = R.sparse_attention(q.cpu(), [(pool.cpu(), g, idx.cpu(), ln.cpu())], None, 192**-0.5, 512)
    assert rel(o.cpu(), ref) < TOL[kv]
    if kv == "fp8" and not cfg:
        try:
            import flash_mla  # noqa: F401
        except ImportError:
            return
        fo, _ = flashmla_sparse_attention(q, Scope(pool, g, idx, ln), sm_scale=192**-0.5, d_v=512)
        assert rel(fo.float(), o.float()) < 1e-2, rel(fo.float(), o.float())
        # extend batches: FlashMLA's sparse prefill over the pool's rows dequantised to bf16 (copy row = slot)
        from sglang_ernie55.attention.kernel_path import _flashmla_prefill, sparse_prefill_runs
        from sglang_ernie55.kernels.kv_store import kv_load

        if sparse_prefill_runs(topk):
            dense = kv_load(pool, g, torch.arange(pool.shape[0] * g.page_size, device=DEV)).unsqueeze(1)
            po = _flashmla_prefill(q, dense, idx, 192**-0.5, 512)
            assert rel(po.float().cpu(), ref) < TOL[kv], rel(po.float().cpu(), ref)
            assert rel(po.float(), fo.float()) < 1e-2, rel(po.float(), fo.float())


def test_hca_attention_inverse_rope_tiny():
    """hca_attention = sparse attention + functional.hca_output's inverse rotation of the rope slice."""
    from sglang_ernie55.reference import rope
    from tests.kernels.hca_attn import hca_attention
    from tests.kernels.kutil import cos_sin

    o, _, (q, main, extra, sink) = _hca_case("bf16", [200, 5], 1, H=2)
    pos = torch.tensor([199, 4], device=DEV)
    inv, c, s = cos_sin(256)
    got = hca_attention(q, main, extra, sink, pos, c, s)
    ref = o.float().cpu()
    ref[..., -64:] = rope.apply_rope_interleaved(ref[..., -64:], pos.cpu(), inv, inverse=True)
    assert rel(got.cpu(), ref) < 1e-2


# ---------------------------------------------------------------- batch invariance (deterministic inference)
def _widen(idx: torch.Tensor, extra_cols: int) -> torch.Tensor:
    """The same index rows, wider (as a CUDA-graph batch pads them to the context's width)."""
    return torch.cat([idx, idx.new_full((idx.shape[0], extra_cols), -1)], 1).contiguous()


def _run_in_batches(q, scopes, split_keys, **kw):
    """Each query alone (T = 1, narrowest rows), then all in one batch with 64 more -1 columns per scope, in
    reversed order. Outputs in fp32, as serving takes them (a bf16 output would round differences away).
    Returns (alone [T, h, d], batched [T, h, d]) in the original order."""
    T, H = q.shape[:2]
    out = lambda n: poison((n, H, kw["d_v"]), torch.float32)  # noqa: E731
    alone = []
    for t in range(T):
        sc = [
            Scope(
                s.pool,
                s.geom,
                s.indices[t : t + 1, : max(1, int(s.lengths[t]))].contiguous(),
                s.lengths[t : t + 1].contiguous(),
            )
            for s in scopes
        ]
        o, _ = sparse_mqa_attention(q[t : t + 1].contiguous(), *sc, split_keys=split_keys, out=out(1), **kw)
        alone.append(o)
    rev = torch.arange(T - 1, -1, -1, device=q.device)
    sc = [Scope(s.pool, s.geom, _widen(s.indices[rev], 64), s.lengths[rev].contiguous()) for s in scopes]
    ob, _ = sparse_mqa_attention(q[rev].contiguous(), *sc, split_keys=split_keys, out=out(T), **kw)
    return torch.cat(alone), ob[rev]


def _invariance_cases():
    """(q, scopes, kwargs) of an HCA case (window + compressed + sink, tiny dims) and an MLA case whose rows hold
    up to 600 keys (several splits)."""
    torch.manual_seed(3)
    reqs = PagedRequests([19, 130, 300, 700])
    g = L.hca_geometry("fp8", dim=128, rope=64)
    gc = L.hca_geometry("fp8", dim=128, rope=64, page_size=L.HCA_CMP_PER_PAGE)
    win_pool, _ = filled_pool(g, reqs.num_pages, 128)
    cmp_pool, _ = filled_pool(gc, reqs.num_pages, 128)
    queries = [(r, p) for r, L_ in enumerate(reqs.seq_lens) for p in (L_ - 2, L_ - 1)]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries)
    hca = (
        torch.randn(len(queries), 4, 128, device=DEV).to(torch.bfloat16),
        [Scope(win_pool, g, wi, wl), Scope(cmp_pool, gc, ci, cl)],
        dict(sm_scale=128**-0.5, d_v=128, sink=torch.randn(4, device=DEV)),
    )
    gm = L.mla_geometry("bf16")
    mreqs = PagedRequests([40, 300, 600])
    pool, _ = filled_pool(gm, mreqs.num_pages, 576)
    mq = [(r, s - 1) for r, s in enumerate(mreqs.seq_lens)] + [(2, 450)]
    idx, ln = mreqs.mla_indices(mq)
    mla = (
        torch.randn(len(mq), 16, 576, device=DEV).to(torch.bfloat16),
        [Scope(pool, gm, idx, ln)],
        dict(sm_scale=192**-0.5, d_v=512),
    )
    return {"hca": hca, "mla": mla}


@pytest.mark.parametrize("kind", ["hca", "mla"])
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_split_keys_batch_invariant(kind, var):
    """With fixed key splits (SGLang's --enable-deterministic-inference) a query's output is bit-identical
    whether it runs alone on its narrowest index row or inside a batch, reordered, with wider (-1 padded)
    rows; the split size that serving uses (256) and a small one that forces several splits per row."""
    q, scopes, kw = _invariance_cases()[kind]
    kw = dict(kw, **VAR[var])
    for split_keys in (64, 256):
        alone, batched = _run_in_batches(q, scopes, split_keys, **kw)
        assert torch.equal(alone, batched), (split_keys, (alone.float() - batched.float()).abs().max().item())
    # still the right attention (not merely a stable one)
    ref = R.sparse_attention(
        q.cpu(),
        [(s.pool.cpu(), s.geom, s.indices.cpu(), s.lengths.cpu()) for s in scopes],
        kw.get("sink").cpu() if kw.get("sink") is not None else None,
        kw["sm_scale"],
        kw["d_v"],
    )
    assert rel(alone.cpu(), ref) < TOL["fp8"], rel(alone.cpu(), ref)


def test_default_splits_follow_the_batch():
    """The control: the default split count follows the batch (T, widths), so the same MLA query alone and in a
    batch goes through different splits (one-split shortcut vs the combine pass) and is not bit-identical."""
    q, scopes, kw = _invariance_cases()["mla"]
    alone, batched = _run_in_batches(q, scopes, None, **kw)
    assert not torch.equal(alone, batched)


def test_split_keys_checks():
    q, scopes, kw = _invariance_cases()["mla"]
    with pytest.raises(ValueError, match="split_keys"):
        sparse_mqa_attention(q, *scopes, split_keys=100, **kw)
    with pytest.raises(ValueError, match="exclude"):
        sparse_mqa_attention(q, *scopes, split_keys=64, num_splits=2, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("var", ["default", "dc64"])
def test_split_keys_batch_invariant_full(kv, var):
    """Full width (64 heads, HCA 512 with sink, MLA 576 with top-k 2048 rows) on the GPU's bf16 MMAs: alone vs
    batched, bit-identical with split_keys=256 (what serving uses under --enable-deterministic-inference)."""
    torch.manual_seed(4)
    reqs = PagedRequests([1, 127, 129, 300, 3001, 20000])
    g, gc = L.hca_geometry(kv), L.hca_geometry(kv, page_size=L.HCA_CMP_PER_PAGE)
    win_pool, _ = filled_pool(g, reqs.num_pages, 512)
    cmp_pool, _ = filled_pool(gc, reqs.num_pages, 512)
    queries = [(r, s - 1) for r, s in enumerate(reqs.seq_lens)]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries)
    q = torch.randn(len(queries), 64, 512, device=DEV).to(torch.bfloat16)
    kw = dict(sm_scale=512**-0.5, d_v=512, sink=torch.randn(64, device=DEV), **VAR[var])
    alone, batched = _run_in_batches(q, [Scope(win_pool, g, wi, wl), Scope(cmp_pool, gc, ci, cl)], 256, **kw)
    assert torch.equal(alone, batched), (alone - batched).abs().max().item()
    gm = L.mla_geometry(kv)
    pool, _ = filled_pool(gm, reqs.num_pages, 576)
    rows = [[reqs.slot(r, s) for s in torch.randperm(p + 1)[:2048].tolist()] for r, p in queries]
    idx = torch.full((len(rows), 2048), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    ln = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    mq = torch.randn(len(rows), 64, 576, device=DEV).to(torch.bfloat16)
    alone, batched = _run_in_batches(
        mq, [Scope(pool, gm, idx.to(DEV), ln.to(DEV))], 256, sm_scale=192**-0.5, d_v=512, **VAR[var]
    )
    assert torch.equal(alone, batched), (alone - batched).abs().max().item()


@pytest.mark.parametrize("kind", ["hca", "mla"])
def test_fp32_queries_run_ieee_fp32(kind):
    """An fp32 query (fp32 activations: the exactness runs) runs every dot in IEEE fp32: against the fp32
    reference over the same bf16 pool the error is fp32 rounding, far below the bf16-operand tolerance."""
    q, scopes, kw = _invariance_cases()[kind]
    q = (q.float() + 1e-3 * torch.randn_like(q.float())).contiguous()  # not bf16-representable
    out = poison((q.shape[0], q.shape[1], kw["d_v"]), torch.float32)
    o, _ = sparse_mqa_attention(q, *scopes, out=out, **kw)
    sink = kw.get("sink")
    ref = R.sparse_attention(
        q.cpu(),
        [(s.pool.cpu(), s.geom, s.indices.cpu(), s.lengths.cpu()) for s in scopes],
        sink.cpu() if sink is not None else None,
        kw["sm_scale"],
        kw["d_v"],
    )
    assert rel(o.cpu(), ref) < 1e-5, rel(o.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_fp32_queries_full_width(kv):
    """Full head width (512) on the GPU: fp32 queries give fp32-accurate attention (TF32 or bf16 operands would
    not). 16 heads: the fp32 mode serves exactness runs at the tiny geometry; at 64 heads its [64, 512] fp32
    tiles spill so heavily that this test did not finish inside the H200 suite's time (2026-12-03)."""
    torch.manual_seed(5)
    reqs = PagedRequests([1, 129, 3001])
    g, gc = L.hca_geometry(kv), L.hca_geometry(kv, page_size=L.HCA_CMP_PER_PAGE)
    win_pool, _ = filled_pool(g, reqs.num_pages, 512)
    cmp_pool, _ = filled_pool(gc, reqs.num_pages, 512)
    queries = [(r, s - 1) for r, s in enumerate(reqs.seq_lens)]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries)
    q = torch.randn(len(queries), 16, 512, device=DEV)
    sink = torch.randn(16, device=DEV)
    o, _ = sparse_mqa_attention(
        q,
        Scope(win_pool, g, wi, wl),
        Scope(cmp_pool, gc, ci, cl),
        sm_scale=512**-0.5,
        d_v=512,
        sink=sink,
        out=torch.empty(len(queries), 16, 512, device=DEV),
    )
    ref = R.sparse_attention(
        q.cpu(),
        [(win_pool.cpu(), g, wi.cpu(), wl.cpu()), (cmp_pool.cpu(), gc, ci.cpu(), cl.cpu())],
        sink.cpu(),
        512**-0.5,
        512,
    )
    assert rel(o.cpu(), ref) < 1e-5, rel(o.cpu(), ref)
