"""Lightning indexer: logits over the paged key pool vs the reference; top-k exact (the reference
rule applied to the same logits), lengths, slots through the page table; key widths that are not powers of
two (index_head_dim 48: held padded inside the kernel)."""

import pytest
import torch

from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels.indexer import (
    LOGITS_DECODE,
    LOGITS_EXTEND,
    indexer_logits,
    indexer_topk,
    indexer_topk_torch,
)
from sglang_ernie55.reference import functional as F
from sglang_ernie55.reference import kernels_ref as R
from tests.kernels.kutil import DEV, PagedRequests, filled_pool, poison


def _case(kv, seq_lens, q_per_req, nI, topk, dI=L.IDX_HEAD_DIM, config=None):
    """q_per_req: the last rows of each request queried (an int for all, or one per request)."""
    torch.manual_seed(0)
    g = L.idx_geometry(kv, dI)
    reqs = PagedRequests(seq_lens)
    pool, _ = filled_pool(g, reqs.num_pages, dI)
    per = q_per_req if isinstance(q_per_req, list) else [q_per_req] * len(seq_lens)
    queries = [(r, p) for r, s in enumerate(seq_lens) for p in range(max(0, s - per[r]), s)]
    T = len(queries)
    q_req = torch.tensor([r for r, _ in queries], dtype=torch.int32, device=DEV)
    q_pos = torch.tensor([p for _, p in queries], dtype=torch.int32, device=DEV)
    qI = torch.randn(T, nI, dI, device=DEV).to(torch.bfloat16)
    w = torch.randn(T, nI, device=DEV) * (nI**-0.5 * dI**-0.5)
    S = max(seq_lens)
    pt = reqs.page_table.to(DEV)
    out = poison((T, S), torch.float32)
    lg = indexer_logits(qI, w, pool, g, pt, q_req, q_pos, S, out=out, config=config)
    ref = R.indexer_logits_paged(qI.cpu(), w.cpu(), pool.cpu(), g, pt.cpu(), q_req.cpu(), q_pos.cpu())
    for t, r in enumerate(ref):
        a = lg[t, : len(r)].cpu()
        assert torch.allclose(a, r, rtol=1e-3, atol=1e-3 * r.abs().max().item()), t
        assert torch.isneginf(lg[t, len(r) :]).all()
    idx, ln = indexer_topk(lg, q_pos, topk)
    assert ln.tolist() == [min(p + 1, topk) for _, p in queries]
    sel = F.indexer_topk(lg.cpu(), q_pos.cpu(), torch.arange(S), topk)
    for t in range(T):
        got = idx[t, : ln[t]].cpu()
        assert (idx[t, ln[t] :] == -1).all()
        assert sorted(got.tolist()) == sel[t].nonzero().flatten().tolist()
        # the selection agrees with the reference logits up to near-ties
        r = ref[t]
        if len(r) > topk:
            thr = torch.sort(r, descending=True).values[topk - 1]
            assert (r[got.long()] >= thr - 1e-3 * r.abs().max()).all()
    slots, _ = indexer_topk(lg, q_pos, topk, pt, q_req)
    for t, (r, _) in enumerate(queries):
        exp = [reqs.slot(r, s) for s in idx[t, : ln[t]].tolist()]
        assert slots[t, : ln[t]].tolist() == exp


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_indexer_tiny(kv):
    _case(kv, [1, 19, 300], 1, nI=4, topk=16)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "config",
    [
        LOGITS_DECODE,
        LOGITS_EXTEND,
        (16, 4, True, False),
        (16, 4, True, True),
        (32, 4, False, True),
        (16, 4, True, False, 2),
        (16, 4, True, True, 4),
        (32, 4, True, True, 8),
    ],
    ids=str,
)
def test_indexer_configs_ragged_extend(kv, config):
    """Serving's two launch configs and narrow ones (keys major or not, 1 to 8 query rows per program) on
    ragged extend rows: the short requests' rows lie whole key tiles before the 300-key width (tiles skipped,
    written -inf); groups of rows that span two requests (3 + 7 + 5 + 1 rows), a last group past the rows."""
    _case(kv, [3, 19, 300, 70], [3, 7, 5, 1], nI=5, topk=16, config=config)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("dI", [48, 24])
def test_indexer_odd_head_dim(kv, dI):
    """index_head_dim 48 (the geometry matrix's) and 24: key and query rows held at 64 / 32 columns, the padding
    masked; 3 heads (head block padded to 16), two queries per request: logits, top-k and slots as above."""
    _case(kv, [1, 19, 300], 2, nI=3, topk=16, dI=dI)


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["tiny", "full"])
def test_indexer_fp32_queries_ieee(on_gpu):
    """fp32 indexer queries (fp32 activations) run IEEE fp32 dots: logits within fp32 rounding of the reference."""
    torch.manual_seed(6)
    nI = 64 if on_gpu else 4
    g = L.idx_geometry("bf16")
    reqs = PagedRequests([19, 300])
    pool, _ = filled_pool(g, reqs.num_pages, 128)
    q_req = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    q_pos = torch.tensor([18, 299], dtype=torch.int32, device=DEV)
    qI = torch.randn(2, nI, 128, device=DEV)
    w = torch.randn(2, nI, device=DEV)
    pt = reqs.page_table.to(DEV)
    lg = indexer_logits(qI, w, pool, g, pt, q_req, q_pos, 300, out=poison((2, 300), torch.float32))
    ref = R.indexer_logits_paged(qI.cpu(), w.cpu(), pool.cpu(), g, pt.cpu(), q_req.cpu(), q_pos.cpu())
    for t, r in enumerate(ref):
        assert torch.allclose(lg[t, : len(r)].cpu(), r, rtol=1e-5, atol=1e-5 * r.abs().max().item()), t


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize(
    "config",
    [
        LOGITS_DECODE,
        LOGITS_EXTEND,
        (128, 4, True, False),
        (128, 4, True, True),
        (64, 4, False, True),
        (64, 8, True, True, 4),
        (32, 8, True, True, 8),
    ],
    ids=str,
)
def test_indexer_full(kv, config):
    _case(kv, [1, 97, 2048, 2049, 9000], [1, 3, 2, 5, 9], nI=64, topk=2048, config=config)


@pytest.mark.parametrize(
    "config", [(64, 4, True, True, 8), (128, 8, True, False, 8), (64, 8, True, True, 16)]
)
def test_rows_configs_past_the_measured_dot_are_refused(config):
    """More than ROWS_HEADS_MAX query rows x heads at over 32 keys per step (wrong logits on the H100 at 64
    keys x 8 rows x 64 heads) is refused before any launch, naming the config; 32 keys passes the check."""
    g = L.idx_geometry("fp8")
    reqs = PagedRequests([40])
    pool, _ = filled_pool(g, reqs.num_pages, L.IDX_HEAD_DIM)
    T, pt = 8, reqs.page_table.to(DEV)
    q_req = torch.zeros(T, dtype=torch.int32, device=DEV)
    q_pos = torch.arange(32, 40, dtype=torch.int32, device=DEV)
    qI = torch.zeros(T, 64, L.IDX_HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(T, 64, device=DEV)
    out = torch.full((T, 40), 7.0, device=DEV)
    with pytest.raises(
        ValueError, match=rf"config \({config[0]}, .* 64 heads: rows x heads {config[4] * 64} > 256"
    ):
        indexer_logits(qI, w, pool, g, pt, q_req, q_pos, 40, out=out, config=config)
    assert bool((out == 7.0).all())  # nothing written
    indexer_logits(qI, w, pool, g, pt, q_req, q_pos, 40, out=out, config=(32, *config[1:]))
    assert bool((out[:, :32] == 0).all()) and bool((out[:, 32:] <= 0).all())  # zero queries: 0 or -inf


def test_topk_ties_go_to_earlier_positions():
    lg = torch.tensor([[1.0, 2.0, 2.0, 2.0, -1.0, float("-inf")]], device=DEV)
    idx, ln = indexer_topk(lg, torch.tensor([4], device=DEV), 2)
    assert sorted(idx[0].tolist()) == [1, 2] and ln.tolist() == [2]


def _rows(T, S, seed, stride_pad=0, tie_every=3):
    """Random logits [T, S] (a view of a wider buffer when stride_pad), a third of each row tied to one value,
    runs of +0.0 and -0.0, -inf past each row's causal end; q_pos spread over short and long rows."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(T, S + stride_pad, generator=g)
    buf[:, ::tie_every] = buf[:, 1:2]
    buf[:, 1::7] = 0.0
    buf[:, 2::7] = -0.0
    lg = buf[:, :S]
    q_pos = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
    q_pos[0] = S - 1
    lg[torch.arange(S)[None, :] > q_pos[:, None].long()] = float("-inf")
    return lg, q_pos


def _check_topk(lg, q_pos, topk, idx, ln, slot_of=None):
    """idx / ln against the reference's selection (functional.indexer_topk: stable sort of the float logits):
    lengths, the selected keys in increasing position order (as slots: mapped in that order), -1 after them."""
    T, S = lg.shape
    sel = F.indexer_topk(lg, q_pos, torch.arange(S), topk)
    idx, ln = idx.cpu(), ln.cpu()
    assert ln.tolist() == [min(int(p) + 1, topk) for p in q_pos]
    for t in range(T):
        n = int(ln[t])
        want = sel[t].nonzero().flatten().tolist()
        if slot_of is not None:
            want = [slot_of(t, s) for s in want]
        got = idx[t, :n].tolist()
        assert got == want, (t, sorted(set(got) ^ set(want))[:8])  # both in increasing position order
        assert (idx[t, n:] == -1).all(), t


@pytest.mark.parametrize(
    "T,S,topk,block,page",
    [
        (4, 50, 16, 4096, 256),  # rows shorter and longer than the top-k inside one step
        (5, 700, 64, 128, 64),  # many steps per pass, 64-token pages
        (3, 3000, 2048, 1024, 256),  # the model's top-k, rows past it
        (3, 300, 512, 64, 128),  # every row shorter than the top-k: all causal keys, padded to 512
    ],
)
def test_topk_kernel_selects_what_the_reference_selects(T, S, topk, block, page):
    """The one-launch top-k (positions and cache slots) equals the reference's stable-sort selection on rows
    with heavy ties across the cut and -0.0 beside +0.0 (equal floats: the earlier position wins)."""
    lg, q_pos = _rows(T, S, seed=T * S + topk, stride_pad=5)
    idx, ln = indexer_topk(lg.to(DEV), q_pos.to(DEV), topk, config=(block, 4))
    _check_topk(lg, q_pos, topk, idx, ln)
    reqs = PagedRequests([S, S + 17], page_size=page)  # shuffled pages
    q_req = torch.tensor([t % 2 for t in range(T)], dtype=torch.int32)
    pt = reqs.page_table.to(DEV)
    slots, sl = indexer_topk(lg.to(DEV), q_pos.to(DEV), topk, pt, q_req.to(DEV), page, config=(block, 4))
    _check_topk(lg, q_pos, topk, slots, sl, slot_of=lambda t, s: reqs.slot(int(q_req[t]), s))
    # the torch twin selects the same set (in logit order)
    tw, tn = indexer_topk_torch(lg.to(DEV), q_pos.to(DEV), topk, pt, q_req.to(DEV), page)
    assert torch.equal(tn.cpu(), sl.cpu())
    for t in range(T):
        n = int(sl[t])
        assert sorted(tw[t, :n].tolist()) == sorted(slots[t, :n].tolist())


def test_topk_signed_zero_ties_to_the_earlier_position():
    """-0.0 and +0.0 are one value: at the cut, the earlier of them is taken (an ordering on the raw bits would
    rank +0.0 above -0.0 and take the later key)."""
    lg = torch.tensor([[1.0, -0.0, 0.0, 0.0, -1.0]], device=DEV)
    pos = torch.tensor([4], dtype=torch.int32, device=DEV)
    for fn in (indexer_topk, indexer_topk_torch):
        idx, ln = fn(lg, pos, 2)
        assert sorted(idx[0, :2].tolist()) == [0, 1] and ln.tolist() == [2], fn.__name__


@pytest.mark.gpu
def test_topk_kernel_full():
    """Full size: 64 decode rows over 32K keys, top-2048, as cache slots through 256-token pages."""
    lg, q_pos = _rows(64, 32768, seed=9)
    reqs = PagedRequests([32768] * 4)
    q_req = (torch.arange(64) % 4).to(torch.int32)
    idx, ln = indexer_topk(lg.to(DEV), q_pos.to(DEV), 2048, reqs.page_table.to(DEV), q_req.to(DEV))
    _check_topk(lg, q_pos, 2048, idx, ln, slot_of=lambda t, s: reqs.slot(int(q_req[t]), s))


def _sampled_candidates(row: torch.Tensor, n: int, k: int, sample: int) -> int | None:
    """How many candidates the sampled top-k takes for a row of n keys (None: the row is outside the sampled
    range), by the kernel's rule: so the tests below know which of its two paths each row ran."""
    if not (2 * sample <= n <= k * (sample // 8)):
        return None
    key = lambda x: torch.where(x == 0, torch.zeros_like(x), x)  # noqa: E731  (-0 equals +0)
    v = torch.sort(row[(torch.arange(sample, dtype=torch.int64) * n) // sample], descending=True).values
    e = torch.tensor(k * sample / n, dtype=torch.float32)
    r = min(int(e + 4.0 * e.sqrt() + 4.0), sample - 1)
    return int((key(row[:n]) >= key(v[r])).sum())


@pytest.mark.parametrize("kind", ["distinct", "ties", "sample_high", "flat"])
def test_topk_sampled_selects_what_the_reference_selects(kind):
    """The sampled top-k (sample 256, top-300) equals the reference's selection, as positions and as slots,
    on rows that take each of its paths: distinct logits (candidates between k and the cap), a third of each
    row tied to one value with signed zeros (either path), the sampled keys set above all others (fewer than
    k candidates) and flat rows (more than the cap where longer than it): those fall back to the whole row."""
    T, S, topk, sample = 6, 4000, 300, 256
    lg, q_pos = _rows(T, S, seed=17, stride_pad=3, tie_every=S if kind != "ties" else 3)
    q_pos[1:] = torch.tensor([600, 1500, 2047, 3333, 400], dtype=torch.int32)
    if kind == "sample_high":
        for t in range(T):
            n = int(q_pos[t]) + 1
            lg[t, (torch.arange(sample) * n) // sample] = 50.0
    if kind == "flat":
        lg[:] = 1.0
    lg[torch.arange(S)[None, :] > q_pos[:, None].long()] = float("-inf")
    counts = [_sampled_candidates(lg[t], int(q_pos[t]) + 1, topk, sample) for t in range(T)]
    assert counts[-1] is None  # a row too short to sample
    if kind == "distinct":
        assert all(topk <= c <= 4 * topk for c in counts[:-1]), counts
    if kind == "sample_high":
        assert all(c < topk for c in counts[:-1]), counts
    if kind == "flat":  # every key a candidate: past the cap in the rows longer than it
        assert counts[:-1] == [int(p) + 1 for p in q_pos[:-1]] and sum(c > 4 * topk for c in counts[:-1]) == 4
    idx, ln = indexer_topk(lg.to(DEV), q_pos.to(DEV), topk, config=(512, 4, sample))
    _check_topk(lg, q_pos, topk, idx, ln)
    reqs = PagedRequests([S, S + 17], page_size=64)
    q_req = torch.tensor([t % 2 for t in range(T)], dtype=torch.int32)
    pt = reqs.page_table.to(DEV)
    slots, sl = indexer_topk(lg.to(DEV), q_pos.to(DEV), topk, pt, q_req.to(DEV), 64, config=(512, 4, sample))
    _check_topk(lg, q_pos, topk, slots, sl, slot_of=lambda t, s: reqs.slot(int(q_req[t]), s))


def test_topk_sample_must_be_a_power_of_two():
    lg = torch.zeros(1, 64, device=DEV)
    with pytest.raises(ValueError, match="sample 100"):
        indexer_topk(lg, torch.tensor([63], device=DEV), 8, config=(64, 4, 100))


@pytest.mark.parametrize(
    "T, S, topk, sample, launched",
    [
        (4, 500, 64, 256, 0),  # narrower than 2 sample: no row could sample
        (4, 4000, 300, 256, 256),  # the scratch (4 topk per row) within the logits
        (600, 4096, 2048, 1024, 0),  # many short rows: the scratch would be 4x the logits and past 32 MiB
        (256, 4096, 2048, 1024, 1024),  # decode-sized: 4x the logits but 16 MiB
    ],
)
def test_topk_sample_only_where_its_scratch_is_small(monkeypatch, T, S, topk, sample, launched):
    """The launch keeps the config's sample only where some row can take it and its scratch stays within the
    chunk's logits or 32 MiB (the kernel is recorded, not run)."""
    from sglang_ernie55.kernels import indexer as IX

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((grid, kw["SAMPLE"], tuple(a[9].shape)))

    monkeypatch.setattr(IX, "indexer_topk_kernel", Spy())
    lg = torch.zeros(T, S, device=DEV)
    indexer_topk(lg, torch.full((T,), S - 1, dtype=torch.int32, device=DEV), topk, config=(512, 4, sample))
    assert seen[0][:2] == ((T,), launched)
    assert seen[0][2] == ((T, 4 * topk) if launched else (T, S))  # the scratch only when sampling


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [1024, 2048])
def test_topk_sampled_full(sample):
    """Full size, as an extend chunk launches it: 512 rows at positions 32256-32767 over 32K keys (weighted
    ReLU head sums, as the indexer writes them), top-2048 as slots; the sampled selection equals the radix
    one."""
    g = torch.Generator().manual_seed(sample)
    lg = torch.relu(torch.randn(512, 32768, 8, generator=g)).mul(torch.rand(8, generator=g)).sum(-1)
    q_pos = torch.arange(32256, 32768, dtype=torch.int32)
    lg[torch.arange(32768)[None, :] > q_pos[:, None].long()] = float("-inf")
    reqs = PagedRequests([32768])
    q_req = torch.zeros(512, dtype=torch.int32)
    args = (lg.to(DEV), q_pos.to(DEV), 2048, reqs.page_table.to(DEV), q_req.to(DEV))
    want = indexer_topk(*args, config=(1024, 4))
    got = indexer_topk(*args, config=(1024, 4, sample))
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
