"""Ernie55Config: full-size defaults, the parameter arithmetic, and validation errors that name the field."""

from __future__ import annotations

import pytest

from sglang_ernie55.configuration import (
    ARCH_MAIN,
    Ernie55Config,
    Ernie55ConfigError,
    default_layer_types,
    tiny_config,
)
from sglang_ernie55.reference import build_reference


def test_full_size_defaults_follow_the_spec():
    c = Ernie55Config()
    assert c.architectures == [ARCH_MAIN] and c.model_type == "ernie5_5_moe"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (103424, 4096, 43)
    assert c.mla_dsa_layer_ids == [3, 10, 17, 24, 31, 38] and len(c.hca_layer_ids) == 37
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_latent_size) == (512, 10, 2048)
    assert c.rope_scaling["factor"] == 16 and c.rope_scaling["original_max_position_embeddings"] == 65536


def test_parameter_counts_full_size():
    """ARCHITECTURE.md: ~278B total, ~12.8B active. Exact: 278,123,337,815 and 12,791,654,487."""
    counts = Ernie55Config().parameter_counts()
    assert counts["total"] == 278_123_337_815
    assert counts["active"] == 12_791_654_487
    assert 277e9 < counts["total"] < 279e9 and 12.7e9 < counts["active"] < 12.9e9


@pytest.mark.parametrize("overrides", [{}, {"n_shared_experts": 0}, {"layer_types": ["mla_dsa"] * 4}])
def test_parameter_arithmetic_equals_reference_numel(overrides):
    """The config-only arithmetic counts exactly the tensors the reference model builds."""
    cfg = tiny_config(**overrides)
    model = build_reference(cfg, seed=None)
    assert cfg.parameter_counts()["total"] == sum(p.numel() for p in model.parameters())
    echo = sum(p.numel() for n, p in model.named_parameters() if n.startswith("echo."))
    assert cfg.parameter_counts()["echo"] == echo


def test_default_layer_types_rule():
    assert default_layer_types(8) == ["hca"] * 3 + ["mla_dsa"] + ["hca"] * 4
    assert Ernie55Config(num_hidden_layers=11).layer_types == default_layer_types(11)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"layer_types": ["hca"] * 3}, "layer_types"),
        ({"layer_types": ["hca", "csa", "hca", "hca"]}, "layer_types"),
        ({"num_attention_heads": 12}, "o_groups"),
        ({"compress_ratio": 96}, "compress_ratio"),
        ({"window_size": 512}, "window_size"),
        ({"num_experts_per_tok": 20}, "num_experts_per_tok"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ],
)
def test_validation_names_the_field(overrides, field):
    with pytest.raises(Ernie55ConfigError, match=rf"`{field}`"):
        tiny_config(**overrides)


def test_config_json_round_trip(tmp_path):
    import json

    cfg = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_config_json()))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in raw
    again = Ernie55Config.from_pretrained(tmp_path)
    assert again.layer_types == cfg.layer_types and again.index_topk == cfg.index_topk
    assert again.rope_scaling["factor"] == 16
