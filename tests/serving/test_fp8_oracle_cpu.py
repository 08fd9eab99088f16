"""The FP8 oracle of the GPU serving suite (server_harness.fp8_activation_reference / kv_rounded_reference)
checked on CPU against what it stands for:
- the set of FP8-served Linears equals the SGLang model's Linears that carry an FP8 quant method;
- `fp8_act_quant` equals SGLang's own per-token-group FP8 quantisation (its torch path), dequantised;
- the fp8 KV codec equals a round trip through the serving pool (`Ernie55TokenToKVPool` rows);
- the context managers change the reference's output and restore it exactly afterwards.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ernie55.configuration import tiny_config  # noqa: E402
from sglang_ernie55.reference.model import build_reference  # noqa: E402
from tests.serving import server_harness as sh
from tests.serving import twin_harness as th


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def ref(cfg):
    return build_reference(cfg, seed=3, dtype=torch.float32)


def test_fp8_served_linears_match_the_sglang_model(cfg, ref):
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from sglang_ernie55.checkpoint.spec import FP8_QUANTIZATION_CONFIG

    m = th.build_model(cfg, Fp8Config.from_config(dict(FP8_QUANTIZATION_CONFIG)))
    served = set()
    for n, mod in m.named_modules():
        if isinstance(mod, LinearBase) and "Fp8" in type(getattr(mod, "quant_method", None)).__name__:
            served |= set(getattr(mod, "ernie_parts", (n,)))  # a merged Linear: the checkpoint Linears it serves
    ours = set(sh.fp8_served_linears(ref, cfg))
    assert served, "the FP8 model serves no Linear in FP8 (policy or SGLang changed)"
    assert ours == served, f"only oracle: {sorted(ours - served)}; only SGLang: {sorted(served - ours)}"
    # and the tiny geometry really has both kinds
    assert any(".wkv" in n for n in ours) and not any(".wq_a" in n for n in ours)


def _act_input(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 384, generator=g) * torch.logspace(-3, 2, 384)
    x[3] = 0.0  # all-zero groups: the amax floor
    x[5, :128] = -1e-12  # a group whose values all round far below the scale
    return x.to(device)


def test_fp8_act_quant_is_sglang_group_quant_formula():
    """Per group of 128: the max |value| maps to exactly +-448 (e4m3 max), every value lands on the scaled
    e4m3 grid, relative error <= 2**-4 for normal codes, zero groups stay zero. (Equality with SGLang's
    CUDA kernel itself: test_server_gpu.py::test_fp8_act_quant_equals_sglang_cuda_kernel.)"""
    x = _act_input()
    y = sh.fp8_act_quant(x)
    g, yg = x.view(37, 3, 128), y.view(37, 3, 128)
    amax = g.abs().amax(-1, keepdim=True)
    codes = yg / (amax.clamp_min(1e-10) * (1.0 / 448.0))  # back to e4m3 codes, up to fp32 rounding
    top = codes.abs().amax(-1, keepdim=True)[amax > 1e-10]  # below the floor the codes stay small
    torch.testing.assert_close(top, torch.full_like(top, 448.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        codes, codes.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=1e-30
    )  # on the grid
    big = codes.abs() >= 2**-6  # normal e4m3 codes
    assert ((yg - g).abs() <= 2**-4 * g.abs() + 1e-30)[big].all()
    assert torch.equal(y[3], torch.zeros(384))


@pytest.mark.parametrize("kv", ["fp8_e4m3", "bfloat16"])
def test_kv_codec_equals_the_serving_pool(cfg, kv):
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    pool = Ernie55TokenToKVPool(1024, 256, dtype, cfg, num_req_slots=2, device="cpu")
    codec = sh.kv_codec(kv, cfg)
    g = torch.Generator().manual_seed(1)
    loc = torch.randperm(1024, generator=g)[:50] + 256
    hca = torch.randn(50, cfg.head_dim, generator=g) * 3
    lat, pe = (
        torch.randn(50, cfg.kv_lora_rank, generator=g),
        torch.randn(50, cfg.qk_rope_head_dim, generator=g),
    )
    ik = torch.randn(50, cfg.index_head_dim, generator=g)
    pool.win[0].write(loc, hca)
    pool.latent[1].write(loc, torch.cat([lat, pe], -1))
    pool.index_k[1].write(loc, ik)
    assert torch.equal(codec["hca"](hca), pool.win[0].read(loc))
    a, b = codec["mla"](lat, pe)
    assert torch.equal(torch.cat([a, b], -1), pool.latent[1].read(loc))
    assert torch.equal(codec["idx"](ik), pool.index_k[1].read(loc))


def test_oracles_change_the_reference_and_restore_it(cfg, ref):
    ids = torch.randint(3, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    ids[0] = cfg.bos_token_id
    base = ref.forward(ids).logits
    with sh.fp8_activation_reference(ref, cfg):
        act = ref.forward(ids).logits
    with sh.kv_rounded_reference("fp8_e4m3", cfg):
        kvq = ref.forward(ids).logits
    assert torch.equal(ref.forward(ids).logits, base)
    for name, y in (("fp8 activations", act), ("fp8 KV", kvq)):
        d = (y - base).abs().max().item()
        assert 1e-4 < d < 10 * base.std().item(), f"{name}: max |change| {d}"
    with pytest.raises(ValueError, match="fp8_e4m3 rounding needs the model config"):
        sh.kv_rounded_reference("fp8_e4m3")
