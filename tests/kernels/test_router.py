"""Multi-router top-k vs functional.multi_router_topk: ids exact (the same ordering rule), weights close."""

import pytest
import torch

from sglang_ernie55.kernels import router
from sglang_ernie55.kernels.router import multi_router_topk, router_logits
from sglang_ernie55.reference import functional as F
from tests.kernels.kutil import DEV


def _check(T, H, E, R, k, ties=False, grid=False):
    """grid: inputs in {-1, 0, 1}, router weights and bias on a 1/64 grid, so every logit is exact in fp32
    whatever the GEMM's blocking (else two duplicated router rows may round 1 ulp apart, which is no tie)."""
    torch.manual_seed(0)
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    routers = [(torch.randn(E, H, device=DEV) * H**-0.5).to(torch.bfloat16) for _ in range(R)]
    bias = torch.randn(E, device=DEV) * 0.1
    if grid:
        x = torch.randint(-1, 2, (T, H), device=DEV).to(torch.bfloat16)
        routers = [(r.float() * 64).round().to(torch.bfloat16) / 64 for r in routers]
        bias = (bias * 64).round() / 64
    if ties:  # exact ties in the biased score: duplicated experts
        for r in routers:
            r[5] = r[3]
        bias[5] = bias[3]
    lg = router_logits(x, torch.cat(routers))
    w, ids = multi_router_topk(lg, R, bias, k, True, 2.5)
    rw, rids = F.multi_router_topk(x.cpu(), [r.cpu() for r in routers], bias.cpu(), k, True, 2.5)
    # the reference's own score path differs by GEMM rounding: compare ids where the scores are not near-ties.
    # bf16 on CUDA takes the tensor cores, whose fp32 accumulation is a few bits short of IEEE (test below)
    tc = x.is_cuda and router.bf16_gemm_works(x.device)
    s = torch.stack([torch.sigmoid(lg.cpu()[:, i * E : (i + 1) * E]) for i in range(R)]).mean(0) + bias.cpu()
    srt = torch.sort(s, dim=-1, descending=True, stable=True)
    assert torch.equal(ids.long().cpu(), srt.indices[:, :k])  # exact on the kernel's own logits
    # a near-tie at the top-k boundary may swap which expert is chosen, one inside the top k only the order;
    # an exact tie (duplicated experts) is one in the reference too, broken the same way
    tol = 1e-4 if tc else 1e-5
    top = srt.values[:, : k + 1] if k < E else torch.cat([srt.values, torch.full((T, 1), -float("inf"))], 1)
    gap = top[:, :-1] - top[:, 1:]
    near = (gap > 0) & (gap <= tol)
    chosen, ordered = ~near[:, k - 1], ~near.any(1)
    assert ordered.float().mean() > 0.5, "too few rows without near-ties: the check below would test nothing"
    assert torch.equal(ids.long().cpu()[ordered], rids[ordered])
    assert torch.allclose(w.cpu()[ordered], rw[ordered], rtol=1e-4, atol=1e-5)
    by_id, ref_by_id = ids.long().cpu().sort(1), rids.sort(1)
    assert torch.equal(by_id.values[chosen], ref_by_id.values[chosen])
    w_by_id, rw_by_id = w.cpu().gather(1, by_id.indices), rw.gather(1, ref_by_id.indices)
    assert torch.allclose(w_by_id[chosen], rw_by_id[chosen], rtol=1e-4, atol=1e-5)
    if ties:
        assert not ((ids == 5).any(1) & ~(ids == 3).any(1)).any()  # 5 never without 3


def test_router_tiny():
    _check(5, 64, 32, 2, 10, ties=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 97, 4096])
def test_router_full(T):
    _check(T, 4096, 512, 2, 10, ties=True)


ODD = [(19, 192, 8, 3, 7), (130, 256, 12, 3, 3), (3, 96, 8, 3, 8), (19, 64, 6, 1, 5)]


@pytest.mark.parametrize("T, H, E, R, k", ODD)
def test_router_odd(T, H, E, R, k):
    """Issue 13's routing: three routers (the mean over a router count that is not a power of two), expert
    counts that are not powers of two, top-k at or next to the expert count; exact ties included."""
    _check(T, H, E, R, k, ties=True, grid=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 97, 8192])
def test_bf16_logits_are_the_fp32_gemm(T):
    """bf16 x and routers on CUDA take one bf16 GEMM with fp32 accumulation and output: the products are exact
    in fp32 and the sums are fp32 but for the tensor cores' accumulation, which keeps fewer guard bits than
    IEEE fp32, so the logits sit within a few 1e-5 of the exact sums (not bf16-rounded: ~1e-3 off)."""
    assert router.bf16_gemm_works(torch.device(DEV)), f"torch {torch.__version__}: the routers run in fp32"
    torch.manual_seed(T)
    x = torch.randn(T, 4096, device=DEV).to(torch.bfloat16)
    w = (torch.randn(1024, 4096, device=DEV) * 4096**-0.5).to(torch.bfloat16)
    got = router_logits(x, w)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32
    # |logit| up to ~6: the tensor cores' sums of 4096 terms were 3.0e-5 off at most (H100, T 8192), an
    # IEEE fp32 GEMM's a few 1e-6; a bf16-rounded output would miss by up to 2^-9 |logit| (~1e-2)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    assert (got.double() - want).abs().mean() < 2e-5  # the typical sum: bf16 rounding would be ~1e-3 off
