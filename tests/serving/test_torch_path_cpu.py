"""The torch attention path (`attention.torch_path`) against the reference math on random pools: keys in many
small chunks (online softmax, running DSA top-k with exact score ties) give what one softmax over every key
gives, and no gather reads more than one chunk of keys per row, even at a 1M-token context."""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.attention import torch_path as tp
from sglang_ernie55.configuration import SERVING_PAGE_SIZE, tiny_config
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool
from sglang_ernie55.reference import functional as Fn

PAGE = SERVING_PAGE_SIZE


class _Compressor:
    """Stands in for the layer's Compressor: a fixed linear map of the block's rows (decode writes entries)."""

    def __init__(self, D):
        self.D = D

    def compress(self, rows, blk):
        return rows[..., : self.D].mean(1) + blk[:, None].float() * 1e-3


def _setup(cfg, lens, dtype=torch.float32, width_extra=0, seed=0):
    """A pool holding random rows for requests of `lens` tokens (request slots 1..), slots page aligned."""
    g = torch.Generator().manual_seed(seed)
    max_ctx = max(lens) + 8 + width_extra
    size = sum(-(-n // PAGE) * PAGE for n in lens) + PAGE
    pool = Ernie55TokenToKVPool(size, PAGE, dtype, cfg, num_req_slots=len(lens) + 1, device="cpu")
    r2t = torch.zeros(len(lens) + 1, max_ctx, dtype=torch.int64)
    nxt = PAGE
    for i, n in enumerate(lens):
        r2t[i + 1, :n] = torch.arange(nxt, nxt + n)
        nxt += -(-n // PAGE) * PAGE
    D, R, r, dI = cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    for lid, kind in enumerate(cfg.layer_types):
        if kind == "hca":
            pool.win[lid].write(torch.arange(size + PAGE), torch.randn(size + PAGE, D, generator=g))
            pool.cmp[lid].write(torch.arange(pool.cmp_rows), torch.randn(pool.cmp_rows, D, generator=g))
        else:
            pool.latent[lid].write(torch.arange(size + PAGE), torch.randn(size + PAGE, R + r, generator=g))
            keys = torch.randn(size + PAGE, dI, generator=g)
            # request slot 1's keys take one of 3 values: the top-k boundary falls inside a run of exact
            # score ties, where the earlier positions must win. Small integers, so that with `_index_inputs`
            # every score of such a key is exact: a tie in any summation order (a BLAS kernel may round a
            # column at the edge of its tile differently from one inside it)
            pick = torch.randint(0, 3, (lens[0],), generator=g)
            keys[PAGE : PAGE + lens[0]] = torch.randint(-3, 4, (3, dI), generator=g).float()[pick]
            pool.index_k[lid].write(torch.arange(size + PAGE), keys)
    return pool, r2t


def _index_inputs(rows: int, nI: int, dI: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries (integers) and head weights (multiples of 1/8): against `_setup`'s integer tie keys every
    product and partial sum of a score is exact in fp32."""
    iq = torch.randn(rows, nI, dI, generator=g).mul(2).round()
    iw = torch.rand(rows, nI, generator=g).mul(8).round().div(8)
    return iq, iw


def _hca_ref(pool, lid, r2t, req, p, q, sink, scale, W, ratio):
    keys_raw = pool.win[lid].read(r2t[req, max(0, p - W + 1) : p + 1])
    nb = (p + 1) // ratio
    blocks = torch.arange(nb)
    keys_cmp = pool.cmp[lid].read(torch.div(r2t[req, blocks * ratio], ratio, rounding_mode="floor"))
    keys = torch.cat([keys_raw, keys_cmp], 0)
    return Fn.sink_attention(q[None], keys, torch.ones(1, keys.shape[0], dtype=torch.bool), sink, scale)[0]


def _mla_ref(pool, lid, r2t, req, p, q, iq, iw, scale, topk, v):
    locs = r2t[req, : p + 1]
    keys, kI = pool.latent[lid].read(locs), pool.index_k[lid].read(locs)
    kpos = torch.arange(p + 1)
    sel = Fn.indexer_topk(Fn.indexer_scores(iq[None], iw[None], kI), torch.tensor([p]), kpos, topk)
    logits = torch.einsum("hc,sc->hs", q.float(), keys) * scale
    logits = logits.masked_fill(~sel[0][None, :], float("-inf"))
    return torch.einsum("hs,sr->hr", torch.softmax(logits, -1), keys[:, :v])


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(tp, "CHUNK_BYTES", 1)  # every chunk at MIN_CHUNK keys
    monkeypatch.setattr(tp, "MIN_CHUNK", 16)
    monkeypatch.setattr(tp, "QUERY_CHUNK", 48)


@pytest.mark.parametrize("geometry", ["tiny", "odd"])
def test_decode_rows_equal_reference(small_chunks, geometry):
    """Decode rows (and verify-like rows of one request at consecutive positions) over a width longer than
    every request: HCA window + compressed entries + sink, MLA over the DSA top-k with score ties."""
    over = (
        {}
        if geometry == "tiny"
        else dict(
            window_size=64,
            compress_ratio=32,
            head_dim=96,
            qk_rope_head_dim=32,
            kv_lora_rank=96,
            index_topk=24,
        )
    )
    cfg = tiny_config(**over)
    lens = [700, 33, 260]
    pool, r2t = _setup(cfg, lens)
    hca, mla = (
        tp.TorchHCA(pool, r2t, cfg.window_size, cfg.compress_ratio),
        tp.TorchMLA(pool, r2t, cfg.index_topk),
    )
    g = torch.Generator().manual_seed(1)
    req = torch.tensor([1, 2, 3, 1])
    pos = torch.tensor([698, 31, 259, 699])  # the last row reads the first one's key too (verify-like)
    loc = torch.zeros(4, dtype=torch.long)  # padding page: writes nothing live, compresses to scratch
    h, D, R, r, dI, nI = 16, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, 8
    sink = torch.randn(h, generator=g)
    q = torch.randn(4, h, D, generator=g)
    out = hca.decode(
        q,
        torch.zeros(4, D),
        torch.zeros(4, 2 * D),
        _Compressor(D),
        sink,
        D**-0.5,
        0,
        loc,
        req,
        pos,
        width=r2t.shape[1],
    )
    for i in range(4):
        want = _hca_ref(
            pool, 0, r2t, int(req[i]), int(pos[i]), q[i], sink, D**-0.5, cfg.window_size, cfg.compress_ratio
        )
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    mla_lid = cfg.layer_types.index("mla_dsa")
    qm = torch.randn(4, h, R + r, generator=g)
    iq, iw = _index_inputs(4, nI, dI, g)
    out = mla.decode(
        qm,
        torch.zeros(4, R + r),
        iq,
        iw,
        torch.zeros(4, dI),
        0.1,
        R,
        mla_lid,
        loc,
        req,
        pos,
        width=r2t.shape[1],
    )
    for i in range(4):
        want = _mla_ref(
            pool, mla_lid, r2t, int(req[i]), int(pos[i]), qm[i], iq[i], iw[i], 0.1, cfg.index_topk, R
        )
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


def test_extend_queries_equal_reference(small_chunks):
    """An extend of 150 queries after a 300-token prefix (several query and key chunks): every query as the
    reference computes it from the same pool rows."""
    cfg = tiny_config(index_topk=40)
    pool, r2t = _setup(cfg, [450])
    hca, mla = (
        tp.TorchHCA(pool, r2t, cfg.window_size, cfg.compress_ratio),
        tp.TorchMLA(pool, r2t, cfg.index_topk),
    )
    g = torch.Generator().manual_seed(3)
    P, E, h = 300, 150, 16
    meta = tp.ExtendMeta(req=[1], prefix=[P], extend=[E])
    loc = r2t[1, P : P + E]
    # keep the pool's rows: write back what is there (the extend writes its own KV first)
    D = cfg.head_dim
    kv = pool.win[0].read(loc)
    state = pool.state[0]
    state.zero_()
    q, sink = torch.randn(E, h, D, generator=g), torch.randn(h, generator=g)
    cs = torch.randn(E, 2 * D, generator=g)
    comp = _Compressor(D)
    cmp_before = pool.cmp[0].read(torch.arange(pool.cmp_rows)).clone()
    out = hca.extend(q, kv, cs, comp, sink, D**-0.5, 0, loc, meta)
    assert not torch.equal(pool.cmp[0].read(torch.arange(pool.cmp_rows)), cmp_before)  # blocks 2, 3 completed
    for i in (0, 1, 77, 149):
        want = _hca_ref(pool, 0, r2t, 1, P + i, q[i], sink, D**-0.5, cfg.window_size, cfg.compress_ratio)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
    R, r, dI, nI = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, 8
    lid = cfg.layer_types.index("mla_dsa")
    kc, ik = pool.latent[lid].read(loc), pool.index_k[lid].read(loc)
    qm = torch.randn(E, h, R + r, generator=g)
    iq, iw = _index_inputs(E, nI, dI, g)
    out = mla.extend(qm, kc, iq, iw, ik, 0.1, R, lid, loc, meta)
    for i in (0, 1, 77, 149):
        want = _mla_ref(pool, lid, r2t, 1, P + i, qm[i], iq[i], iw[i], 0.1, cfg.index_topk, R)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_rank_rows_equal_whole_batch_rows(small_chunks, cp):
    """SGLang's prefill CP (interleave): a rank attends only its query rows (batch rows r, r + cp, ...) over every
    rank's keys. A 3-request extend (prefixes, a window and compression blocks crossed, DSA top-k with score
    ties): each rank's rows equal the same rows of the whole-batch extend, its padding rows are zero, and the
    stored rows, compressed entries and open-block state are the whole batch's."""
    cfg = tiny_config(index_topk=40)
    lens, prefix = [450, 33, 260], [300, 0, 100]
    ext = [n - P for n, P in zip(lens, prefix)]
    T = sum(ext)
    g = torch.Generator().manual_seed(4)
    h, D, R, r, dI, nI = 16, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, 8
    lid = cfg.layer_types.index("mla_dsa")
    q, kv, cs = (
        torch.randn(T, h, D, generator=g),
        torch.randn(T, D, generator=g),
        torch.randn(T, 2 * D, generator=g),
    )
    sink = torch.randn(h, generator=g)
    qm, kc = torch.randn(T, h, R + r, generator=g), torch.randn(T, R + r, generator=g)
    iq, iw, ik = (
        torch.randn(T, nI, dI, generator=g),
        torch.rand(T, nI, generator=g),
        torch.randn(T, dI, generator=g),
    )

    def run(qidx, rows):
        pool, r2t = _setup(cfg, lens)
        pool.state[0].zero_()
        loc = torch.cat([r2t[i + 1, P:n] for i, (n, P) in enumerate(zip(lens, prefix))])
        meta = tp.ExtendMeta(req=[1, 2, 3], prefix=prefix, extend=ext, qidx=qidx, rows=rows)
        sel = slice(None) if qidx is None else torch.tensor(qidx)
        hca = tp.TorchHCA(pool, r2t, cfg.window_size, cfg.compress_ratio)
        mla = tp.TorchMLA(pool, r2t, cfg.index_topk)
        o1 = hca.extend(q[sel], kv, cs, _Compressor(D), sink, D**-0.5, 0, loc, meta)
        o2 = mla.extend(qm[sel], kc, iq[sel], iw[sel], ik, 0.1, R, lid, loc, meta)
        stored = [pool.cmp[0].read(torch.arange(pool.cmp_rows)), pool.state[0].clone(), pool.win[0].read(loc)]
        return o1, o2, stored + [pool.latent[lid].read(loc), pool.index_k[lid].read(loc)]

    whole = run(None, 0)
    rows = -(-T // cp) + 1  # SGLang pads every rank to one row count
    for rank in range(cp):
        qidx = list(range(rank, T, cp))
        o1, o2, stored = run(qidx, rows)
        for got, want in ((o1, whole[0]), (o2, whole[1])):
            assert got.shape[0] == rows
            torch.testing.assert_close(got[: len(qidx)], want[qidx], rtol=1e-5, atol=1e-5)
            assert not got[len(qidx) :].any()
        for got, want in zip(stored, whole[2]):
            assert torch.equal(got, want)


@pytest.mark.slow
def test_million_token_width_reads_one_chunk_at_a_time(monkeypatch):
    """A CUDA-graph decode program spans the whole context length (here 1M + 8 positions) for every row; the
    rows it gathers per read stay within one chunk (CHUNK_BYTES), never rows x context."""
    cfg = tiny_config()
    pool, r2t = _setup(cfg, [300, 20], dtype=torch.bfloat16, width_extra=(1 << 20) - 300)
    width = r2t.shape[1]
    biggest = []
    for rows in (
        list(pool.win.values())
        + list(pool.cmp.values())
        + list(pool.latent.values())
        + list(pool.index_k.values())
    ):
        read = rows.read

        def spy(loc, read=read, rows=rows):
            biggest.append(loc.numel() * tp.read_cost(rows))
            return read(loc)

        monkeypatch.setattr(rows, "read", spy)
    B, h = 2, 16
    req, pos, loc = torch.tensor([1, 2]), torch.tensor([299, 19]), torch.zeros(2, dtype=torch.long)
    g = torch.Generator().manual_seed(5)
    D, R, r, dI = cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    hca = tp.TorchHCA(pool, r2t, cfg.window_size, cfg.compress_ratio)
    o1 = hca.decode(
        torch.randn(B, h, D, generator=g),
        torch.zeros(B, D),
        torch.zeros(B, 2 * D),
        _Compressor(D),
        torch.zeros(h),
        D**-0.5,
        0,
        loc,
        req,
        pos,
        width,
    )
    mla = tp.TorchMLA(pool, r2t, cfg.index_topk)
    lid = cfg.layer_types.index("mla_dsa")
    o2 = mla.decode(
        torch.randn(B, h, R + r, generator=g),
        torch.zeros(B, R + r),
        torch.randn(B, 8, dI, generator=g),
        torch.rand(B, 8, generator=g),
        torch.zeros(B, dI),
        0.1,
        R,
        lid,
        loc,
        req,
        pos,
        width,
    )
    assert torch.isfinite(o1).all() and torch.isfinite(o2).all()
    assert max(biggest) <= tp.CHUNK_BYTES, (max(biggest), tp.CHUNK_BYTES)
    assert sum(biggest) > width * 100  # and the whole width was visited
