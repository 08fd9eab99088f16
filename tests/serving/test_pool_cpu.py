"""Pool sizing arithmetic and the stored-row codecs of `Ernie55TokenToKVPool`."""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import Ernie55Config, tiny_config
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool, RowCodec
from sglang_ernie55.mem_cache.sizing import kv_bytes, normalize_kv_dtype, pool_tokens, row_bytes


def test_row_bytes_full_size():
    # HCA fp8: 448 e4m3 + 7 fp32 tile scales + 64 bf16 rope (stage-1 separate tensors; packed: 584)
    assert row_bytes(512, 64, "fp8_e4m3", 64) == 448 + 28 + 128
    # MLA fp8: 512 e4m3 + 4 fp32 scales + 64 bf16 rope = FlashMLA V3.2's 656
    assert row_bytes(576, 64, "fp8_e4m3", 128) == 656
    assert row_bytes(128, 0, "fp8_e4m3", 128) == 132
    assert row_bytes(512, 64, "bfloat16", 64) == 1024


def test_full_size_bytes_per_token():
    b = kv_bytes(Ernie55Config(), "fp8_e4m3")
    assert (b.n_hca, b.n_mla) == (37, 6)
    per = b.per_full_token(1.0)
    assert per == pytest.approx(37 * (604 + 604 / 128) + 6 * (656 + 132))
    assert b.per_full_token(0.1) < per / 3  # the SWA pool (stage 2) is what makes 1M context cheap


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_pool_allocation_matches_sizing(kv):
    cfg = tiny_config()
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    size, page, slots = 4 * 256, 256, 5
    pool = Ernie55TokenToKVPool(size, page, dtype, cfg, num_req_slots=slots, device="cpu")
    b = kv_bytes(cfg, kv)
    rows = size + page
    want = (rows * (b.n_hca * b.window_row + b.n_mla * (b.latent_row + b.index_row))
            + (rows // 128 + 1) * b.n_hca * b.cmp_row + (slots + 1) * b.state_per_slot)  # fmt: skip
    assert pool.get_kv_size_bytes() == want


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


@pytest.mark.parametrize("ue8m0,tile,rope", [(True, 64, 64), (False, 128, 64), (False, 64, 0)])
def test_fp8_codec_roundtrip(ue8m0, tile, rope):
    g = torch.Generator().manual_seed(0)
    dim = 128 + rope if rope else 64
    c = RowCodec(16, dim, rope, True, tile, ue8m0, "cpu")
    x = torch.randn(5, dim, generator=g) * torch.tensor([0.01, 1, 30, 300, 1e-3])[:, None]
    loc = torch.tensor([3, 7, 1, 15, 8])
    c.write(loc, x)
    y = c.read(loc)
    if rope:
        torch.testing.assert_close(y[:, -rope:], x[:, -rope:].bfloat16().float())
    nope = dim - rope
    err = (y[:, :nope] - x[:, :nope]).abs()
    amax = x[:, :nope].abs().amax(-1, keepdim=True)
    assert (err <= amax * 2 ** (-3 if ue8m0 else -4) + 1e-12).all()
    if ue8m0:
        s = c.scales[loc]
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))
