"""Lightning indexer: logits over the paged key pool vs the reference; top-k exact (the reference
rule applied to the same logits), lengths, slots through the page table; key widths that are not powers of
two (index_head_dim 48: held padded inside the kernel)."""

import pytest
import torch

from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels.indexer import indexer_logits, indexer_topk
from sglang_ernie55.reference import functional as F
from sglang_ernie55.reference import kernels_ref as R
from tests.kernels.kutil import DEV, PagedRequests, filled_pool, poison


def _case(kv, seq_lens, q_per_req, nI, topk, dI=L.IDX_HEAD_DIM):
    torch.manual_seed(0)
    g = L.idx_geometry(kv, dI)
    reqs = PagedRequests(seq_lens)
    pool, _ = filled_pool(g, reqs.num_pages, dI)
    queries = [(r, p) for r, s in enumerate(seq_lens) for p in range(max(0, s - q_per_req), s)]
    T = len(queries)
    q_req = torch.tensor([r for r, _ in queries], dtype=torch.int32, device=DEV)
    q_pos = torch.tensor([p for _, p in queries], dtype=torch.int32, device=DEV)
    qI = torch.randn(T, nI, dI, device=DEV).to(torch.bfloat16)
    w = torch.randn(T, nI, device=DEV) * (nI**-0.5 * dI**-0.5)
    S = max(seq_lens)
    pt = reqs.page_table.to(DEV)
    out = poison((T, S), torch.float32)
    lg = indexer_logits(qI, w, pool, g, pt, q_req, q_pos, S, out=out)
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
def test_indexer_full(kv):
    _case(kv, [1, 97, 2048, 2049, 9000], 3, nI=64, topk=2048)


def test_topk_ties_go_to_earlier_positions():
    lg = torch.tensor([[1.0, 2.0, 2.0, 2.0, -1.0, float("-inf")]], device=DEV)
    idx, ln = indexer_topk(lg, torch.tensor([4], device=DEV), 2)
    assert sorted(idx[0].tolist()) == [1, 2] and ln.tolist() == [2]
