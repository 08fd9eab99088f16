"""Pool sizing arithmetic and the stored rows of `Ernie55TokenToKVPool` (helper-4's byte layouts)."""

from __future__ import annotations

import pytest
import torch
from sglang_ernie55.kernels.layout import hca_geometry, idx_geometry, mla_geometry

from sglang_ernie55.configuration import Ernie55Config, tiny_config
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool, PackedRows
from sglang_ernie55.mem_cache.sizing import kv_bytes, normalize_kv_dtype, pool_tokens


def test_full_size_bytes_per_token():
    b = kv_bytes(Ernie55Config(), "fp8_e4m3")
    assert (b.n_hca, b.n_mla) == (37, 6)
    # SGLang's V4 layout: 149,760 B per 256-token page (585 B/token), compressed 864 B/entry;
    # FlashMLA V3.2 latent 656 B/token; indexer 132 B/token.
    assert b.window_row == 149_760 / 256 and b.cmp_row == 1_728 / 2
    assert (b.latent_row, b.index_row) == (656, 132)
    per = b.per_full_token(1.0)
    assert per == pytest.approx(37 * (585 + 864 / 128) + 6 * (656 + 132))
    assert b.per_full_token(0.1) < per / 3  # the SWA pool (stage 2) is what makes 1M context cheap


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_pool_allocation_matches_sizing(kv):
    cfg = tiny_config()
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    size, page, slots = 4 * 256, 256, 5
    pool = Ernie55TokenToKVPool(size, page, dtype, cfg, num_req_slots=slots, device="cpu")
    b = kv_bytes(cfg, kv)
    rows = size + page
    cmp_pages = -(-(rows // 128 + 1) // 2)
    want = (rows * (b.n_hca * b.window_row + b.n_mla * (b.latent_row + b.index_row))
            + cmp_pages * 2 * b.n_hca * b.cmp_row + (slots + 1) * b.state_per_slot)  # fmt: skip
    assert pool.get_kv_size_bytes() == want
    assert pool.cmp_scratch == pool.cmp_rows - 1 >= rows // 128


def test_pool_tokens_fit_budget_and_align():
    b = kv_bytes(tiny_config(), "fp8_e4m3")
    budget = 3 * 2**30
    n = pool_tokens(budget, b, 256, req_slots=64)
    assert n % 256 == 0 and n > 0
    assert n * b.per_full_token() + 65 * b.state_per_slot <= budget
    assert (n + 256) * b.per_full_token() + 65 * b.state_per_slot > budget


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
    rows = PackedRows(geom, 3 * 256, "cpu")
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
