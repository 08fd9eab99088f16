"""HCA compression into the compressed pool + open-block state, over a request that goes through
chunked prefill and decode, against functional.hca_compress over the whole sequence."""

import pytest
import torch
from kutil import DEV, cos_sin, poison, rel
from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels.hca_compress import hca_compress_store, hca_state_update, plan_compress_jobs

from sglang_ernie55.reference import functional as F
from sglang_ernie55.reference import kernels_ref as R


def _run(kv, seq_lens, chunks, dim=512, rope=64, eps=1e-6):
    """Feeds each request's tokens in the given chunk sizes (a chunk of 1 = a decode step), all requests
    batched together per step; then compares every compressed entry with the whole-sequence reference."""
    torch.manual_seed(0)
    B = len(seq_lens)
    g = L.hca_geometry(kv, dim=dim, rope=rope, page_size=L.HCA_CMP_PER_PAGE)
    max_blocks = max(s // L.HCA_COMPRESS_RATIO for s in seq_lens) + 1
    num_pages = -(-B * max_blocks // 2) + 1
    pool = poison((num_pages, g.page_bytes), torch.uint8)
    state = poison((B + 2, L.HCA_STATE_ROWS, 2 * dim), torch.float32)
    req_slot = [B + 1 - r for r in range(B)]  # request r uses state slot B+1-r
    cmp_slot = lambda r, j: r * max_blocks + j  # noqa: E731
    kvs_all = [torch.randn(s, 2 * dim) for s in seq_lens]
    ape = torch.randn(L.HCA_COMPRESS_RATIO, dim) * 0.5
    w = torch.rand(dim) + 0.5
    inv, cos, sin = cos_sin(max(seq_lens) + 1, rope)
    done = [0] * B
    step = 0
    while any(d < s for d, s in zip(done, seq_lens)):
        n = chunks[min(step, len(chunks) - 1)]
        pre = list(done)
        end = [min(s, d + n) for d, s in zip(done, seq_lens)]
        kvs = torch.cat([kvs_all[r][pre[r] : end[r]] for r in range(B)]).to(DEV)
        jobs = plan_compress_jobs(pre, end, req_slot, cmp_slot, device=DEV)
        # pad the job list with a no-op job (as a CUDA graph would)
        jobs = tuple(torch.cat([j, torch.full((1,), -1 if k == 4 else 0, dtype=j.dtype, device=DEV)])
                     for k, j in enumerate(jobs))  # fmt: skip
        hca_compress_store(pool, g, kvs, state, ape.to(DEV), w.to(DEV), eps, cos, sin, *jobs)
        pos = torch.cat([torch.arange(pre[r], end[r]) for r in range(B)]).to(DEV)
        rs = torch.cat([torch.full((end[r] - pre[r],), req_slot[r]) for r in range(B)]).to(DEV)
        sl = torch.cat([torch.full((end[r] - pre[r],), end[r]) for r in range(B)]).to(DEV)
        hca_state_update(state, kvs, pos, rs, sl)
        done = end
        step += 1
    for r, s in enumerate(seq_lens):
        nb = s // L.HCA_COMPRESS_RATIO
        if nb == 0:
            continue
        ref = F.hca_compress(kvs_all[r][:, :dim], kvs_all[r][:, dim:], ape, w, eps, inv, rope)
        slots = torch.tensor([cmp_slot(r, j) for j in range(nb)])
        got = R.pool_gather(pool.cpu(), g, slots)
        # the cache holds exactly the reference's encoding of (nearly) the same fp32 entry
        enc = pool.cpu().clone()
        R.pool_store(enc, g, slots, ref)
        assert rel(got, ref) < (0.04 if kv == "fp8" else 4e-3)
        exact = R.pool_gather(enc, g, slots)
        mism = (got != exact).float().mean().item()
        assert mism <= (0.0 if DEV == "cpu" else 0.01), (
            f"{mism:.4f} of the values differ from the reference encoding"
        )
        # the open block's rows are in the state
        open_lo = nb * L.HCA_COMPRESS_RATIO
        if open_lo < s:
            st = state[req_slot[r], : s - open_lo].cpu()
            assert torch.equal(st, kvs_all[r][open_lo:s])


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_hca_compress_chunked_tiny(kv):
    # request 0: chunks 100 / 100 / decode x 60 -> blocks 0, 1 (block 1 completes while decoding)
    # request 1: 129 tokens (block 0 completes inside the first chunk, 1 open row)
    _run(kv, [260, 129], [100, 100, 1])


def test_hca_compress_tiny_dims():
    _run("fp8", [256], [130, 1], dim=128, rope=64)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_hca_compress_full(kv):
    _run(kv, [1, 19, 127, 128, 129, 255, 256, 257, 3000, 5001], [1000, 777, 1])
