"""The config-derived tensor spec: names, shapes, kinds; it is the strict loader's contract."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_ernie55.checkpoint.spec import (
    FP8_DTYPE,
    KIND_BF16,
    KIND_FP8,
    KIND_FP32,
    SCALE_SUFFIX,
    checkpoint_format,
    expected_tensors,
    stored_tensors,
)
from sglang_ernie55.configuration import Ernie55Config, tiny_config


@pytest.mark.parametrize("config", [tiny_config(), Ernie55Config()], ids=["tiny", "full"])
def test_spec_counts_equal_parameter_arithmetic(config):
    spec = expected_tensors(config)
    assert sum(math.prod(s.shape) for s in spec.values()) == config.parameter_counts()["total"]


def test_full_size_names_and_counts():
    spec = expected_tensors(Ernie55Config())
    # 43 layers: 2 hc sites x 3 + 2 norms; 6 MLA-DSA, 37 HCA; 42 MoE layers of 512 experts x 3
    assert sum(".experts." in k for k in spec) == 42 * 512 * 3
    assert sum(k.endswith(".self_attn.wo_a.weight") for k in spec) == 37
    assert sum(k.endswith(".self_attn.indexer.wq_b.weight") for k in spec) == 6
    assert spec["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 4096)
    assert spec["model.layers.0.self_attn.wo_a.weight"].shape == (8 * 1024, 64 // 8 * 512)
    assert spec["model.layers.5.mlp.experts.511.down_proj.weight"].shape == (2048, 2048)
    assert spec["model.hc_head.fn"].shape == (4, 4 * 4096)
    assert spec["model.layers.0.attn_hc.fn"].shape == (24, 4 * 4096)
    assert spec["echo.h_proj.weight"].shape == (4096, 4096)


def test_kinds_follow_architecture_rules():
    spec = expected_tensors(tiny_config())
    raw = {k for k, s in spec.items() if s.kind == KIND_FP32}
    assert all(not k.endswith((".weight", ".bias")) for k in raw)
    for k in raw:
        assert k.rsplit(".", 1)[-1] in {
            "fn",
            "base",
            "scale",
            "attn_sink",
            "ape",
            "e_score_correction_bias",
        }, k
    fp8 = {k for k, s in spec.items() if s.kind == KIND_FP8}
    assert all(len(spec[k].shape) == 2 and k.endswith(".weight") for k in fp8)
    for k in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.routers.0.weight",
        "model.layers.1.self_attn.indexer.weights_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.indexer.k_norm.bias",
    ):
        assert spec[k].kind == KIND_BF16, k
    for k in (
        "model.layers.0.self_attn.wq_b.weight",
        "model.layers.1.self_attn.indexer.wk.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.latent_down.weight",
        "echo.e_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ):
        assert spec[k].kind == KIND_FP8, k
    # every remaining bf16 tensor is 1-D (a norm) or one of the listed 2-D exceptions
    two_d_bf16 = {k for k, s in spec.items() if s.kind == KIND_BF16 and len(s.shape) == 2}
    assert all(
        k.startswith(("model.embed_tokens", "lm_head")) or ".routers." in k or "weights_proj" in k
        for k in two_d_bf16
    )


def test_fp8_storage_has_whole_and_ragged_blocks():
    cfg = tiny_config()
    stored = stored_tensors(cfg, "fp8")
    weights = {k: v for k, v in stored.items() if v[1] == FP8_DTYPE}
    assert weights and all(k + SCALE_SUFFIX in stored for k in weights)
    for k, (shape, _) in weights.items():
        assert stored[k + SCALE_SUFFIX] == (
            (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)),
            torch.float32,
        )
    ragged = [k for k, (s, _) in weights.items() if s[0] % 128 or s[1] % 128]
    whole = [k for k, (s, _) in weights.items() if s[0] % 128 == 0 and s[1] % 128 == 0 and min(s) >= 256]
    assert len(ragged) > 10 and len(whole) > 10
    assert stored_tensors(cfg, "bf16").keys() == expected_tensors(cfg).keys()


def test_checkpoint_format_from_quantization_config():
    assert checkpoint_format({}) == "bf16"
    assert (
        checkpoint_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
        == "fp8"
    )
    with pytest.raises(ValueError, match="quant_method = 'awq'"):
        checkpoint_format({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        checkpoint_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})


def test_spec_equals_reference_state_dict():
    """The reference model's state_dict() is the checkpoint: same names, shapes and storage dtypes."""
    from sglang_ernie55.reference.model import build_reference

    cfg = tiny_config()
    model = build_reference(cfg, seed=0)
    spec = expected_tensors(cfg)
    sd = model.state_dict()
    assert set(sd) == set(spec), sorted(set(sd) ^ set(spec))
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: s.shape for k, s in spec.items()}
    dtype_of_kind = {KIND_FP32: torch.float32, KIND_BF16: torch.bfloat16, KIND_FP8: torch.bfloat16}
    assert {k: v.dtype for k, v in sd.items()} == {k: dtype_of_kind[s.kind] for k, s in spec.items()}
