"""The fused decode / verify metadata build (kernels/decode_meta.py, `KernelPath.fused_fixed_meta`) against the
torch build it replaces (`KernelPath.fixed_meta`), field for field, on random batches: shuffled pages, padded
CUDA-graph rows, several windows (not only powers of two), compress ratios and rows per request, with and
without the SWA pool's window mapping; and the start-up checks that fall back to the torch build (of the
metadata, and of the indexer top-k)."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_ernie55.attention import kernel_path as kp

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _path(window, ratio, page, slots, width, mapping=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_pages = width // page
    pages = torch.randperm(slots * n_pages + 8, generator=g)[: slots * n_pages] + 1
    r2t = (pages.view(slots, n_pages, 1) * page + torch.arange(page)).view(slots, width).to(torch.int32)
    pool = SimpleNamespace(
        page_size=page, is_hybrid_swa=mapping is not None, full_to_swa_index_mapping=mapping
    )
    pool.window_loc = None if mapping is None else (lambda full: mapping[full.long()])
    cfg = SimpleNamespace(window_size=window, compress_ratio=ratio, index_topk=64)
    return kp.KernelPath(pool, r2t.to(DEV), cfg)


def _equal(want: kp.KernelMeta, got: kp.KernelMeta) -> None:
    field = kp.meta_difference(want, got)
    if field:
        x, y = getattr(want, field), getattr(got, field)
        raise AssertionError(f"{field} differs: torch build {x}, fused build {y}")


@pytest.mark.parametrize(
    "window,ratio,page,per_req,mapped",
    [
        (128, 128, 256, 1, True),
        (128, 128, 256, 3, True),
        (128, 128, 256, 1, False),
        (64, 32, 256, 4, True),
        (96, 64, 256, 2, False),
        (100, 16, 128, 1, True),
        (128, 128, 256, 130, True),  # a verify width past the ratio: two jobs per request
    ],
)
def test_fused_equals_the_torch_build(window, ratio, page, per_req, mapped):
    g = torch.Generator().manual_seed(window + ratio + per_req)
    slots, width = 7, 6 * page
    mapping = torch.randperm((slots * 6 + 9) * page, generator=g).to(DEV) if mapped else None
    path = _path(window, ratio, page, slots, width, mapping, seed=per_req)
    assert path.fused_meta  # the start-up check passed here
    B = 5
    req = torch.randperm(slots, generator=g)[:B]
    seq = torch.randint(per_req + 1, width + 1, (B,), generator=g)
    seq[0] = min(width, 2 * ratio)  # a block completes on this batch's last token
    loc = torch.cat([path.req_to_token[r, int(L) - per_req : int(L)].cpu().long() for r, L in zip(req, seq)])
    loc[per_req : 2 * per_req] = torch.arange(per_req) % page  # padded row: SGLang's padding page
    req, seq, loc = req.to(DEV), seq.to(DEV), loc.to(DEV)
    for w in (width, int(seq.max())):  # the graph width (context length) and an eager width
        want = path.fixed_meta(req, seq, loc, per_req, w)
        got = path.fused_fixed_meta(req, seq - per_req, per_req, loc, per_req, w)
        _equal(want, got)
        assert int((got.jobs[4] >= 0).sum()) >= 1  # a compression job ran in the comparison


def test_empty_batch():
    path = _path(128, 128, 256, 2, 512)
    z = torch.zeros(0, dtype=torch.int64, device=DEV)
    _equal(path.fixed_meta(z, z, z, 1, 512), path.fused_fixed_meta(z, z, 0, z, 1, 512))


def test_meta_difference_names_the_field():
    path = _path(128, 128, 256, 3, 1024)
    req, seq = torch.tensor([1, 2], device=DEV), torch.tensor([300, 700], device=DEV)
    loc = torch.stack([path.req_to_token[r, int(L) - 1].long() for r, L in zip(req.tolist(), seq)])
    a = path.fixed_meta(req, seq, loc, 1, 1024)
    assert kp.meta_difference(a, path.fused_fixed_meta(req, seq - 1, 1, loc, 1, 1024)) == ""
    for field, bad in (
        ("win_len", dataclasses.replace(a, win_len=a.win_len + 1)),
        ("page_table", dataclasses.replace(a, page_table=a.page_table.long())),  # dtype alone
        ("jobs", dataclasses.replace(a, jobs=a.jobs[:4] + (a.jobs[4] - 1,))),
        ("mla_chunks", dataclasses.replace(a, mla_chunks=())),
        ("index_config", dataclasses.replace(a, index_config=kp.LOGITS_EXTEND)),
    ):
        assert kp.meta_difference(a, bad) == field


def test_start_up_check_falls_back_to_torch(monkeypatch, caplog):
    """A fused build that differs from the torch build in one entry is caught at start-up: the path keeps the
    torch build and says so. The switch turns it off; without CUDA or the interpreter it is off."""
    real = kp.decode_meta

    def off_by_one(*a, **k):
        out = real(*a, **k)
        out["cmp_len"] = out["cmp_len"] + (torch.arange(out["cmp_len"].numel(), device=DEV) == 1).int()
        return out

    monkeypatch.setattr(kp, "decode_meta", off_by_one)
    with caplog.at_level(logging.WARNING):
        path = _path(128, 128, 256, 3, 1024)
    assert not path.fused_meta
    assert "differs from the torch build" in caplog.text and "cmp_len" in caplog.text
    monkeypatch.setattr(kp, "decode_meta", real)
    assert _path(128, 128, 256, 3, 1024).fused_meta
    monkeypatch.setenv("SGLANG_ERNIE55_FUSED_META", "0")
    assert not _path(128, 128, 256, 3, 1024).fused_meta
    monkeypatch.delenv("SGLANG_ERNIE55_FUSED_META")
    if DEV == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not _path(128, 128, 256, 3, 1024).fused_meta


def test_topk_start_up_check_falls_back_to_torch(monkeypatch, caplog):
    """The one-launch indexer top-k serves where it selects what the torch top-k selects at start-up; a kernel
    that loses one selected key is caught (the torch top-k serves, with a warning), and the switch turns it off."""
    path = _path(128, 128, 256, 3, 1024)
    assert path.fused_topk
    assert kp.fused_topk_mismatch(path, torch.device(DEV)) == ""
    real = kp.indexer_topk

    def drops_one(logits, q_pos, topk, *a, **k):
        idx, n = real(logits, q_pos, topk, *a, **k)
        idx[0, 0] = idx[0, 1]  # row 0 has more than top-k keys: one key selected twice, one lost
        return idx, n

    monkeypatch.setattr(kp, "indexer_topk", drops_one)
    with caplog.at_level(logging.WARNING):
        assert not _path(128, 128, 256, 3, 1024).fused_topk
    assert "indexer top-k differs from the torch top-k" in caplog.text and "row 0" in caplog.text
    monkeypatch.setattr(kp, "indexer_topk", real)
    monkeypatch.setenv("SGLANG_ERNIE55_FUSED_TOPK", "0")
    assert not _path(128, 128, 256, 3, 1024).fused_topk
