"""`sglang-ernie55 make-tiny` end to end, and SGLang reading what it writes."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_ernie55.checkpoint.loader import CheckpointReader, load_checkpoint
from sglang_ernie55.checkpoint.spec import FP8_DTYPE, FP8_QUANTIZATION_CONFIG, expected_tensors
from sglang_ernie55.checkpoint.tiny import preset_config, preset_layer_types
from sglang_ernie55.cli.main import main
from sglang_ernie55.configuration import ARCH_MAIN, tiny_config


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("mk")
    out = {}
    for fmt in ("bf16", "fp8"):
        assert main(["make-tiny", "--out", str(root / fmt), "--dtype", fmt, "--seed", "5", "--quiet"]) == 0
        out[fmt] = root / fmt
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_make_tiny_writes_the_real_format(made, fmt):
    d = made[fmt]
    names = {p.name for p in d.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } <= names
    assert sum(n.endswith(".safetensors") for n in names) >= 2
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == [ARCH_MAIN] and cfg["model_type"] == "ernie5_5_moe"
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert cfg.get("quantization_config") == (FP8_QUANTIZATION_CONFIG if fmt == "fp8" else None)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen == {
        "do_sample": False,
        "temperature": 1.0,
        "top_p": 0.95,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config, sd = load_checkpoint(d)
    assert config.to_config_json() == tiny_config().to_config_json() | (
        {"quantization_config": FP8_QUANTIZATION_CONFIG} if fmt == "fp8" else {}
    )
    assert list(sd) == list(expected_tensors(config))
    stored = CheckpointReader(d).stored
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight"][1] == (
        FP8_DTYPE if fmt == "fp8" else torch.bfloat16
    )
    assert stored["model.layers.1.mlp.routers.0.weight"][1] == torch.bfloat16
    assert stored["model.hc_head.fn"][1] == torch.float32


def test_make_tiny_refuses_then_forces(made, capsys):
    d = str(made["bf16"])
    assert main(["make-tiny", "--out", d, "--quiet"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert main(["make-tiny", "--out", d, "--seed", "5", "--force"]) == 0
    err = capsys.readouterr().err
    assert "wrote shard 1" in err and "tensors in" in err  # progress lines by default


def test_seed_changes_weights_and_is_reproducible(made, tmp_path):
    assert main(["make-tiny", "--out", str(tmp_path / "a"), "--seed", "5", "--quiet"]) == 0
    assert main(["make-tiny", "--out", str(tmp_path / "b"), "--seed", "6", "--quiet"]) == 0
    _, a = load_checkpoint(tmp_path / "a")
    _, b = load_checkpoint(tmp_path / "b")
    _, ref = load_checkpoint(made["bf16"])
    assert all(torch.equal(a[k], ref[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_layers_option(tmp_path):
    assert (
        main(["make-tiny", "--out", str(tmp_path / "l"), "--layers", "5", "--init", "spec", "--quiet"]) == 0
    )
    config, sd = load_checkpoint(tmp_path / "l")
    assert config.layer_types == ["hca", "mla_dsa", "hca", "mla_dsa", "hca"]
    assert "model.layers.4.mlp.experts.15.down_proj.weight" in sd
    assert main(["make-tiny", "--out", str(tmp_path / "z"), "--layers", "0"]) == 2


def test_full_width_refuses_the_in_memory_init(tmp_path, capsys):
    out = tmp_path / "fw"
    assert main(["make-tiny", "--out", str(out), "--preset", "full-width", "--init", "reference"]) == 1
    assert "use --init spec" in capsys.readouterr().err and not out.exists()


def test_presets():
    assert preset_config("tiny").to_config_json() == tiny_config().to_config_json()
    assert preset_layer_types(4) == tiny_config().layer_types
    fw = preset_config("full-width", layers=4)
    assert (
        fw.hidden_size,
        fw.num_attention_heads,
        fw.n_routed_experts,
        fw.moe_latent_size,
        fw.vocab_size,
    ) == (
        4096,
        64,
        512,
        2048,
        103424,
    )
    assert fw.layer_types == ["hca", "mla_dsa", "hca", "hca"] and fw.num_hidden_layers == 4
    assert (fw.bos_token_id, fw.eos_token_id) == (1, 2)
    assert preset_config("full-width").num_hidden_layers == 4


def test_help_reads_like_a_man_page(capsys):
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("--dtype", "--preset", "full-width", "_scale_inv", "--force", "examples:"):
        assert word in out


def test_sglang_model_config_resolves_our_class(made):
    """`make-tiny --dtype fp8` output, read by SGLang's ModelConfig on CPU through the plugin."""
    from sglang_ernie55 import plugin

    plugin.register()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry

    mc = ModelConfig(model_path=str(made["fp8"]))
    assert type(mc.hf_config).__module__ == "sglang_ernie55.configuration"
    assert mc.hf_config.architectures == [ARCH_MAIN]
    assert mc.quantization == "fp8"
    cls, arch = ModelRegistry.resolve_model_cls(mc.hf_config.architectures)
    assert arch == ARCH_MAIN
    assert f"{cls.__module__}.{cls.__qualname__}" == "sglang_ernie55.models.ernie55.Ernie5_5_MoeForCausalLM"


def test_reuse_returns_the_same_recipe_and_rewrites_another(tmp_path):
    """`make_checkpoint(reuse=True)` writes once and returns that checkpoint untouched for the same preset,
    format and seed (no shard rewritten), and writes again for another seed or format; a checkpoint made
    without `reuse` (no recipe) is never taken for one."""
    from sglang_ernie55.checkpoint.tiny import RECIPE_FILE, make_checkpoint

    out = tmp_path / "ck"
    said = []
    make_checkpoint(out, dtype="bf16", force=True, reuse=True, progress=said.append)
    shards = {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")}
    assert shards and (out / RECIPE_FILE).is_file()
    said.clear()
    assert make_checkpoint(out, dtype="bf16", force=True, reuse=True, progress=said.append) == out
    assert said and said[0].startswith("reusing") and len(said) == 1, said
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("*.safetensors")} == shards
    before = load_checkpoint(out)[1]
    make_checkpoint(out, dtype="bf16", seed=1, force=True, reuse=True)  # another seed: written again
    assert not torch.equal(load_checkpoint(out)[1]["lm_head.weight"], before["lm_head.weight"])
    make_checkpoint(out, dtype="fp8", seed=1, force=True, reuse=True)  # another format: written again
    assert json.loads((out / "config.json").read_text())["quantization_config"] == FP8_QUANTIZATION_CONFIG
    plain = tmp_path / "plain"
    make_checkpoint(plain, dtype="bf16")
    assert not (plain / RECIPE_FILE).exists()
    said.clear()
    make_checkpoint(plain, dtype="bf16", force=True, reuse=True, progress=said.append)
    assert not any(m.startswith("reusing") for m in said) and (plain / RECIPE_FILE).is_file()


def test_a_checkpoint_that_does_not_fit_is_refused_before_writing(tmp_path, monkeypatch):
    """With too little free space the writer refuses before creating anything, naming the folder, the bytes it
    needs and the bytes free; an existing checkpoint there is left as it was."""
    import shutil

    from sglang_ernie55.checkpoint import writer
    from sglang_ernie55.checkpoint.tiny import make_checkpoint, preset_config

    out = tmp_path / "ck"
    make_checkpoint(out, dtype="bf16")
    files = sorted(p.name for p in tmp_path.rglob("*"))
    need = writer.stored_bytes(preset_config("tiny"), "bf16")
    on_disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert need <= on_disk < need + 64 * 1024  # the tensors plus the shards' headers
    real = shutil.disk_usage
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: real(p)._replace(free=need // 2))
    with pytest.raises(OSError, match=r"needs about .* GB and .* has 0\.0 GB free") as e:
        make_checkpoint(out, dtype="bf16", seed=3, force=True)
    assert str(out) in str(e.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == files  # no staging folder left, nothing replaced
