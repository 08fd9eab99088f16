import torch
from kutil import PagedRequests
from sglang_ernie55.kernels.hca_meta import hca_indices


def test_hca_indices_match_the_paged_requests():
    reqs = PagedRequests([1, 19, 127, 128, 129, 256, 257, 3000])
    queries = [(r, p) for r, s in enumerate(reqs.seq_lens) for p in sorted({0, s // 2, s - 1})]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries, device="cpu")
    q_req = torch.tensor([r for r, _ in queries], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in queries], dtype=torch.int32)
    win, win_len, cmp, cmp_len = hca_indices(reqs.page_table, reqs.page_table, q_req, q_pos, cmp_width=64)
    assert torch.equal(win_len, wl) and torch.equal(cmp_len, cl)
    for t in range(len(queries)):
        assert win[t, : wl[t]].tolist() == wi[t, : wl[t]].tolist()
        assert (win[t, wl[t] :] == -1).all()
        assert cmp[t, : cl[t]].tolist() == ci[t, : cl[t]].tolist()
        assert (cmp[t, cl[t] :] == -1).all()
