"""The geometry matrix (tests/serving/geometries.py) without a server: the fp8_e4m3 KV rule
(`kernels.layout.fp8_unfit`) and what argument resolution does with it, for every variant; and the strict
loader on widths SGLang's CPU runner pads.

- fp8_unfit is '' exactly where the fp8 layouts build, and otherwise names the config.json field and value;
- unset / `auto` KV dtype: fp8_e4m3 where it fits, else bfloat16 with one log line naming the field;
- an explicit `--kv-cache-dtype fp8_e4m3` (or `--speculative-draft-kv-cache-dtype fp8_e4m3`) that does not fit:
  `Ernie55ArgumentError` naming the flag, the field, its value and bfloat16; `bfloat16` always resolves;
- SGLang's own padding (`update_intermediate_size`, what `--device cpu` applies to the served config): the
  checkpoint loads into the leading part of the padded parameters with zeros after it, the padded MLPs compute
  what the reference computes, and a tensor of any other width (the padded one included) is refused by name.

Resolution costs SGLang's import (~15 s) once per session, then ~50 ms per case.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_ernie55.args import Ernie55ArgumentError, resolve_server_args, write_config_checkpoint  # noqa: E402
from sglang_ernie55.configuration import SGLANG_PADDED_WIDTHS, checkpoint_config  # noqa: E402
from sglang_ernie55.kernels.layout import fp8_unfit, hca_geometry, idx_geometry, mla_geometry  # noqa: E402
from tests.serving import geometries as G

NAMES = [v.name for v in G.VARIANTS]
ROUTED = "-> bfloat16, not the model's default fp8_e4m3: "


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("geometry-config")
    return {v.name: write_config_checkpoint(root / v.name, v.config()) for v in G.VARIANTS}


def resolve(path: str, *flags: str):
    return resolve_server_args(["--model-path", path, *flags], device="cpu")


def _fp8_layouts_build(cfg) -> str:
    """'' when every fp8 geometry the config's layer kinds use builds, else the layout's assertion."""
    try:
        if "hca" in cfg.layer_types:
            for page in (256, 256 // cfg.compress_ratio):
                hca_geometry("fp8_e4m3", cfg.head_dim, cfg.qk_rope_head_dim, page)
        if "mla_dsa" in cfg.layer_types:
            mla_geometry("fp8_e4m3", cfg.kv_lora_rank, cfg.qk_rope_head_dim, 256)
            idx_geometry("fp8_e4m3", cfg.index_head_dim, 256)
    except AssertionError as e:
        return str(e)
    return ""


def test_matrix_is_accepted_and_varies_what_it_says():
    cfgs = {v.name: v.config() for v in G.VARIANTS}  # Ernie55Config.check_fields accepts each
    assert len(cfgs) >= 8 and "tiny" in cfgs
    seen = lambda f: {f(c) for c in cfgs.values()}  # noqa: E731
    assert len(seen(lambda c: (c.window_size, c.compress_ratio))) >= 4
    assert seen(lambda c: c.num_routers) >= {1, 2, 3}
    assert any(c.layer_types[0] == "mla_dsa" for c in cfgs.values())
    assert any(set(c.layer_types) == {"hca"} for c in cfgs.values())
    assert any(c.layer_types[-1] == "mla_dsa" for c in cfgs.values())
    assert any(c.moe_intermediate_size % 32 for c in cfgs.values())
    assert any(c.num_experts_per_tok == c.n_routed_experts for c in cfgs.values())
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    assert any(not pow2(c.head_dim) and not pow2(c.v_head_dim) for c in cfgs.values())
    for c in cfgs.values():
        assert 128 <= c.hidden_size <= 256 and 2 <= c.num_hidden_layers <= 4 and c.vocab_size == 512


@pytest.mark.parametrize("name", NAMES)
def test_fp8_rule_is_the_layouts_rule(name):
    v = G.BY_NAME[name]
    cfg = v.config()
    why = fp8_unfit(cfg)
    built = _fp8_layouts_build(cfg)
    assert bool(why) == bool(built), (name, why, built)
    assert bool(why) == bool(v.fp8_kv), (name, why)
    if why:
        value = getattr(cfg, v.fp8_kv)
        assert why.startswith(f"config.json {v.fp8_kv} {value}"), why
        assert "must be a multiple of" in why and "fp8_e4m3" in why, why


@pytest.mark.parametrize("name", NAMES)
def test_default_kv_dtype_routes_by_geometry(name, ckpts, caplog):
    v = G.BY_NAME[name]
    for flags in ((), ("--kv-cache-dtype", "auto")):
        with caplog.at_level(logging.INFO, logger="sglang_ernie55.args.overrides"):
            caplog.clear()
            got = resolve(ckpts[name], *flags).resolved_dict()["kv_cache_dtype"]
        notes = [r.getMessage() for r in caplog.records if ROUTED in r.getMessage()]
        if v.fp8_kv:
            assert got == "bfloat16", (name, flags, got)
            assert (
                len(notes) == 1 and f"config.json {v.fp8_kv} {getattr(v.config(), v.fp8_kv)}" in notes[0]
            ), notes
        else:
            assert got == "fp8_e4m3" and not notes, (name, flags, got, notes)


@pytest.mark.parametrize("name", NAMES)
def test_explicit_fp8_refused_where_it_does_not_fit(name, ckpts):
    v = G.BY_NAME[name]
    assert (
        resolve(ckpts[name], "--kv-cache-dtype", "bfloat16").resolved_dict()["kv_cache_dtype"] == "bfloat16"
    )
    spec = ("--speculative-algorithm", "EAGLE")
    cases = (("--kv-cache-dtype",), (*spec, "--speculative-draft-kv-cache-dtype"))
    for *pre, flag in cases:
        argv = (*pre, flag, "fp8_e4m3")
        if not v.fp8_kv:
            d = resolve(ckpts[name], *argv).resolved_dict()
            assert d[flag[2:].replace("-", "_")] == "fp8_e4m3", (name, argv)
            continue
        with pytest.raises(Ernie55ArgumentError) as info:
            resolve(ckpts[name], *argv)
        e, msg = info.value, str(info.value)
        assert (e.flag, e.value) == (flag, "fp8_e4m3"), (name, e.flag, e.value)
        value = getattr(v.config(), v.fp8_kv)
        assert f"config.json {v.fp8_kv} {value}" in msg and "multiple of" in msg, msg
        assert f"{flag} bfloat16" in msg and "bfloat16" in e.legal, msg


def test_pool_sizing_builds_only_the_kinds_present():
    from sglang_ernie55.mem_cache.sizing import kv_bytes

    cfg = G.BY_NAME["w32_c128_hca_only"].config()
    cfg.kv_lora_rank = 96
    assert fp8_unfit(cfg) == ""
    layout = kv_bytes(cfg, "fp8_e4m3")  # an unused kv_lora_rank the fp8 latent layout cannot tile
    assert layout.n_mla == 0 and layout.latent_row == 0.0 and layout.window_row > 0


# ---------------------------------------------------------------------------------------------- the loader
def _sglang_padded(cfg, pad: int = 32):
    """The served config as SGLang's `--device cpu` runner makes it (update_config.update_intermediate_size over
    the widths `adjust_config_with_unaligned_cpu_tp` pads; 32 = its padding without FP8 blocks at TP 1)."""
    from sglang.srt.configs.update_config import update_intermediate_size

    served = copy.deepcopy(cfg)
    holder = SimpleNamespace(hf_config=served)
    for attr in SGLANG_PADDED_WIDTHS:
        update_intermediate_size(holder, attr, pad)
    return served


@pytest.fixture(scope="module")
def padded_model():
    from sglang_ernie55.reference.model import build_reference
    from tests.serving import twin_harness as th

    cfg = G.BY_NAME["w64_c64_r1"].config()  # moe_inter 40, dense inter 200, shared 96
    ref = build_reference(cfg, seed=0)
    served = _sglang_padded(cfg)
    model = th.build_model(served, dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    th.torch_experts(model)
    return cfg, served, ref, model, th


def test_loader_fills_padded_widths_with_zeros(padded_model):
    cfg, served, ref, model, _ = padded_model
    assert (
        served.moe_intermediate_size,
        served.intermediate_size,
        served.shared_expert_intermediate_size,
    ) == (
        64,
        224,
        96,
    )
    assert checkpoint_config(served).moe_intermediate_size == 40 and checkpoint_config(cfg) is cfg
    sd = ref.state_dict()
    i, I, P = 1, cfg.moe_intermediate_size, served.moe_intermediate_size
    ex = model.model.layers[i].mlp.experts
    for e in range(cfg.n_routed_experts):
        p = f"model.layers.{i}.mlp.experts.{e}."
        w13, w2 = ex.w13_weight[e], ex.w2_weight[e]
        assert torch.equal(w13[:I], sd[p + "gate_proj.weight"].float()) and not w13[I:P].any()
        assert torch.equal(w13[P : P + I], sd[p + "up_proj.weight"].float()) and not w13[P + I :].any()
        assert torch.equal(w2[:, :I], sd[p + "down_proj.weight"].float()) and not w2[:, I:].any()
    dense = model.model.layers[0].mlp
    n, N = cfg.intermediate_size, served.intermediate_size
    gate, up = dense.gate_up_proj.weight[:N], dense.gate_up_proj.weight[N:]  # the merged Linear: [gate | up]
    assert dense.gate_up_proj.weight.shape[0] == 2 * N
    assert torch.equal(gate[:n], sd["model.layers.0.mlp.gate_proj.weight"].float()) and not gate[n:].any()
    assert torch.equal(up[:n], sd["model.layers.0.mlp.up_proj.weight"].float()) and not up[n:].any()
    assert torch.equal(dense.down_proj.weight[:, :n], sd["model.layers.0.mlp.down_proj.weight"].float())
    assert not dense.down_proj.weight[:, n:].any()


@torch.no_grad()
def test_padded_mlps_compute_the_reference(padded_model):
    cfg, _, ref, model, _ = padded_model
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i in (0, 1):  # the dense FFN and a latent MoE layer
        got = model.model.layers[i].mlp(x)
        want = ref.model.layers[i].mlp(x)
        assert torch.allclose(got.float(), want.float(), atol=1e-5, rtol=1e-5), (i, (got - want).abs().max())


def test_loader_refuses_other_widths_by_name(padded_model):
    cfg, served, ref, _, th = padded_model
    sd = dict(ref.state_dict())
    bad = {
        "model.layers.1.mlp.experts.3.gate_proj.weight": (41, cfg.moe_latent_size),
        "model.layers.2.mlp.experts.0.down_proj.weight": (cfg.moe_latent_size, served.moe_intermediate_size),
        "model.layers.0.mlp.up_proj.weight": (served.intermediate_size, cfg.hidden_size),
    }
    for name, shape in bad.items():
        sd[name] = torch.zeros(shape)
    from sglang_ernie55.models.ernie55 import Ernie55WeightError

    with pytest.raises(Ernie55WeightError) as info:
        th.build_model(served, dtype=torch.float32).load_weights(sd.items())
    msg = str(info.value)
    assert msg.count("mis-shaped checkpoint tensor") == len(bad), msg
    want = checkpoint_config(served)
    for name, shape in bad.items():
        assert f"mis-shaped checkpoint tensor {name}: {shape}" in msg, msg
    assert f"expected ({want.moe_intermediate_size}, {cfg.moe_latent_size})" in msg, msg
