import pytest
import torch

from sglang_ernie55.kernels.hca_meta import hca_indices
from tests.kernels.kutil import PagedRequests

# (window, compress ratio): the full-size model's, then geometries a config may take (window <= 256, any ratio
# dividing the 256-token page): window 64 / ratio 32, window 32 < ratio 128, ratio 64, the extremes 1 and 256
GEOMETRIES = [(128, 128), (64, 32), (32, 128), (128, 64), (256, 1), (7, 256)]


@pytest.mark.parametrize("window,ratio", GEOMETRIES)
def test_hca_indices_match_the_paged_requests(window, ratio):
    reqs = PagedRequests([1, 19, 127, 128, 129, 256, 257, 3000], window=window, ratio=ratio)
    queries = [(r, p) for r, s in enumerate(reqs.seq_lens) for p in sorted({0, s // 2, s - 1})]
    (wi, wl), (ci, cl) = reqs.hca_indices(queries, device="cpu")
    q_req = torch.tensor([r for r, _ in queries], dtype=torch.int32)
    q_pos = torch.tensor([p for _, p in queries], dtype=torch.int32)
    width = -(-max(3000 // ratio, 1) // 64) * 64
    kw = {} if (window, ratio) == (128, 128) else dict(window=window, ratio=ratio)  # the defaults: full size
    win, win_len, cmp, cmp_len = hca_indices(
        reqs.page_table, reqs.page_table, q_req, q_pos, cmp_width=width, **kw
    )
    assert win.shape[1] == window and cmp.shape[1] == width
    assert torch.equal(win_len, wl) and torch.equal(cmp_len, cl)
    for t in range(len(queries)):
        assert win[t, : wl[t]].tolist() == wi[t, : wl[t]].tolist()
        assert (win[t, wl[t] :] == -1).all()
        assert cmp[t, : cl[t]].tolist() == ci[t, : cl[t]].tolist()
        assert (cmp[t, cl[t] :] == -1).all()


def test_hca_indices_refuse_a_ratio_that_does_not_divide_the_page():
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="ratio"):
        hca_indices(z[None], z[None], z, z, 64, window=64, ratio=96)
    with pytest.raises(ValueError, match="window"):
        hca_indices(z[None], z[None], z, z, 64, window=300, ratio=128)
