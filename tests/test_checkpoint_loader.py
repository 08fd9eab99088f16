"""Writer and strict loader: shards + index, every offending tensor named, nothing half-loaded or half-written."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_ernie55.checkpoint.loader import CheckpointReader, load_checkpoint
from sglang_ernie55.checkpoint.random_init import iter_random_tensors
from sglang_ernie55.checkpoint.spec import (
    FP8_DTYPE,
    KIND_FP8,
    KIND_FP32,
    CheckpointError,
    expected_tensors,
    stored_tensors,
)
from sglang_ernie55.checkpoint.writer import INDEX_FILE, write_checkpoint
from sglang_ernie55.configuration import tiny_config

CFG = tiny_config()


@pytest.fixture(scope="module")
def weights():
    return dict(iter_random_tensors(CFG, seed=3))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        fmt: write_checkpoint(root / fmt, CFG, weights, fmt, max_shard_bytes="2MB") for fmt in ("bf16", "fp8")
    }


def _edit(src: Path, dst: Path, drop=(), add=None, replace=None, index_only_drop=()) -> Path:
    """Copy checkpoint `src` to `dst`, then drop / add / replace stored tensors (index kept consistent)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_FILE).read_text())
    wm = index["weight_map"]
    first = sorted(set(wm.values()))[0]
    edits: dict[str, dict] = {}

    def shard(file):
        if file not in edits:
            edits[file] = load_file(str(dst / file))
        return edits[file]

    for name in drop:
        del shard(wm.pop(name))[name]
    for name, t in (add or {}).items():
        shard(first)[name] = t
        wm[name] = first
    for name, t in (replace or {}).items():
        shard(wm[name])[name] = t
    for name in index_only_drop:
        wm.pop(name)
    for file, tensors in edits.items():
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return dst


# ----------------------------------------------------------------------------------- round trips


def test_bf16_round_trip(ckpts, weights):
    config, sd = load_checkpoint(ckpts["bf16"])
    spec = expected_tensors(config)
    assert list(sd) == list(spec)
    for name, t in sd.items():
        assert t.dtype == torch.float32
        want = weights[name] if spec[name].kind == KIND_FP32 else weights[name].to(torch.bfloat16).float()
        assert torch.equal(t, want), name


def test_fp8_round_trip_dequantizes_within_e4m3(ckpts, weights):
    config, sd = load_checkpoint(ckpts["fp8"], dtype=torch.bfloat16)
    spec = expected_tensors(config)
    assert list(sd) == list(spec) and not any(k.endswith("_scale_inv") for k in sd)
    for name, t in sd.items():
        ref = weights[name] if spec[name].kind == KIND_FP32 else weights[name].to(torch.bfloat16).float()
        if spec[name].kind == KIND_FP32:
            assert t.dtype == torch.float32 and torch.equal(t, ref), name
        elif spec[name].kind == KIND_FP8:
            rel = (t.float() - ref).norm() / ref.norm()
            assert t.dtype == torch.bfloat16 and 0 < rel < 0.035, (name, rel)
        else:
            assert torch.equal(t.float(), ref), name


def test_shards_and_index(ckpts):
    for fmt, path in ckpts.items():
        index = json.loads((path / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 3, fmt
        assert files == sorted(p.name for p in path.glob("*.safetensors"))
        n = len(files)
        assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        stored = stored_tensors(CFG, fmt)
        assert set(index["weight_map"]) == set(stored)
        nbytes = sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in stored.values())
        assert index["metadata"]["total_size"] == nbytes
        reader = CheckpointReader(path)
        assert reader.stored == stored
        for f in files:  # each shard within the limit (a lone bigger tensor excepted)
            tensors = load_file(str(path / f))
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            assert size <= 2_000_000 or len(tensors) == 1


def test_single_file_without_index(tmp_path, weights):
    path = write_checkpoint(tmp_path / "one", CFG, weights, "fp8", max_shard_bytes="1GB")
    (path / INDEX_FILE).unlink()
    (path / "model-00001-of-00001.safetensors").rename(path / "model.safetensors")
    _, sd = load_checkpoint(path)
    assert list(sd) == list(expected_tensors(CFG))


def test_progress_reports_shards(tmp_path, weights):
    msgs = []
    path = write_checkpoint(tmp_path / "p", CFG, weights, "bf16", progress=msgs.append)
    assert sum(m.startswith("wrote shard") for m in msgs) >= 3
    msgs.clear()
    load_checkpoint(path, progress=msgs.append)
    assert sum(m.startswith("read model-") for m in msgs) >= 3


# ----------------------------------------------------------------------------------- strictness


def test_missing_tensor_named(ckpts, tmp_path):
    name = "model.layers.2.self_attn.compressor.ape"
    bad = _edit(ckpts["bf16"], tmp_path / "c", drop=[name])
    with pytest.raises(
        CheckpointError, match=r"1 missing: model\.layers\.2\.self_attn\.compressor\.ape"
    ) as e:
        load_checkpoint(bad)
    assert e.value.missing == [name] and not e.value.unexpected and not e.value.mismatched


def test_unexpected_tensor_named(ckpts, tmp_path):
    name = "model.layers.9.mlp.gate_proj.weight"
    bad = _edit(ckpts["bf16"], tmp_path / "c", add={name: torch.zeros(3, 3, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"1 unexpected: model\.layers\.9\.mlp\.gate_proj\.weight") as e:
        load_checkpoint(bad)
    assert e.value.unexpected == [name]


def test_misshaped_tensor_named(ckpts, tmp_path):
    name = "model.layers.1.mlp.routers.1.weight"
    bad = _edit(ckpts["bf16"], tmp_path / "c", replace={name: torch.zeros(17, 256, dtype=torch.bfloat16)})
    with pytest.raises(
        CheckpointError, match=r"routers\.1\.weight \(found \[17, 256\] bfloat16, expected \[16, 256\]"
    ):
        load_checkpoint(bad)


def test_mistyped_tensor_named_and_float_widths_accepted(ckpts, tmp_path):
    name = "model.layers.0.attn_hc.fn"  # raw parameter, fp32 in the spec
    bad = _edit(ckpts["bf16"], tmp_path / "a", replace={name: torch.zeros(24, 1024, dtype=torch.int32)})
    with pytest.raises(
        CheckpointError, match=r"attn_hc\.fn \(found \[24, 1024\] int32, expected \[24, 1024\] float32"
    ):
        load_checkpoint(bad)
    norm = "model.layers.2.input_layernorm.weight"  # bf16 in the spec
    bad = _edit(ckpts["bf16"], tmp_path / "b", replace={norm: torch.zeros(256, dtype=FP8_DTYPE)})
    with pytest.raises(
        CheckpointError,
        match=r"input_layernorm\.weight \(found \[256\] float8_e4m3fn, expected \[256\] bfloat16",
    ):
        load_checkpoint(bad)
    # another float width for a non-FP8 tensor reads (a real checkpoint may keep norms in fp32)
    ok = _edit(
        ckpts["bf16"],
        tmp_path / "c",
        replace={
            name: torch.full((24, 1024), 0.5, dtype=torch.bfloat16),
            norm: torch.full((256,), 0.25, dtype=torch.float32),
        },
    )
    _, sd = load_checkpoint(ok, dtype=torch.bfloat16)
    assert sd[name].dtype == torch.float32 and (sd[name] == 0.5).all()
    assert sd[norm].dtype == torch.bfloat16 and (sd[norm] == 0.25).all()


def test_fp8_scale_missing_or_misshaped_named(ckpts, tmp_path):
    w = "model.layers.1.self_attn.q_b_proj.weight"
    bad = _edit(ckpts["fp8"], tmp_path / "a", drop=[w + "_scale_inv"])
    with pytest.raises(
        CheckpointError, match=r"missing: model\.layers\.1\.self_attn\.q_b_proj\.weight_scale_inv"
    ):
        load_checkpoint(bad)
    bad = _edit(ckpts["fp8"], tmp_path / "b", replace={w + "_scale_inv": torch.ones(16, 1)})
    with pytest.raises(
        CheckpointError, match=r"q_b_proj\.weight_scale_inv \(found \[16, 1\] float32, expected \[16, 2\]"
    ):
        load_checkpoint(bad)
    bad = _edit(ckpts["fp8"], tmp_path / "c", replace={w: torch.zeros(2048, 192, dtype=torch.bfloat16)})
    with pytest.raises(
        CheckpointError,
        match=r"q_b_proj\.weight \(found \[2048, 192\] bfloat16, expected \[2048, 192\] float8_e4m3fn",
    ):
        load_checkpoint(bad)


def test_every_problem_named_at_once_and_nothing_read(ckpts, tmp_path, monkeypatch):
    drop = ["lm_head.weight", "echo.norm.weight"]
    add = {"model.layers.1.mlp.experts.16.up_proj.weight": torch.zeros(96, 128, dtype=torch.bfloat16)}
    replace = {"model.layers.3.self_attn.attn_sink": torch.zeros(15)}
    bad = _edit(ckpts["bf16"], tmp_path / "c", drop=drop, add=add, replace=replace)
    reads = []
    monkeypatch.setattr(CheckpointReader, "tensor", lambda self, name, dtype=None: reads.append(name))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    msg = str(e.value)
    for name in [*drop, *add, *replace]:
        assert name in msg
    assert e.value.missing == drop and list(add) == e.value.unexpected
    assert [m[0] for m in e.value.mismatched] == list(replace)
    assert reads == []  # strict check first: no tensor data read from a bad checkpoint


def test_index_and_shards_must_agree(ckpts, tmp_path):
    bad = _edit(ckpts["bf16"], tmp_path / "a", index_only_drop=["model.norm.weight"])
    with pytest.raises(
        CheckpointError,
        match=r"model\.norm\.weight \(in model-\d+-of-\d+\.safetensors but not in the index\)",
    ):
        CheckpointReader(bad)
    index = json.loads((ckpts["bf16"] / INDEX_FILE).read_text())
    bad = _edit(ckpts["bf16"], tmp_path / "b")
    index["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors"
    (bad / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard files that do not exist: model-00099-of-00099"):
        CheckpointReader(bad)


def test_config_problems(ckpts, tmp_path):
    bad = _edit(ckpts["bf16"], tmp_path / "a")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        load_checkpoint(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quant_method = 'awq'"):
        load_checkpoint(bad)
    # a bf16 checkpoint declared fp8: every Linear is then mis-typed and every scale missing
    (bad / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    with pytest.raises(
        CheckpointError,
        match=r"missing: .*wq_a\.weight_scale_inv.* mis-shaped: .*wq_a\.weight \(found \[192, 256\] bfloat16",
    ):
        load_checkpoint(bad)


# ----------------------------------------------------------------------------------- writer


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_writer_strict_on_whole_state_dict(tmp_path, weights):
    sd = dict(weights)
    del sd["model.norm.weight"]
    sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2, 2)
    sd["lm_head.weight"] = torch.zeros(511, 256)
    with pytest.raises(CheckpointError) as e:
        write_checkpoint(tmp_path / "w", CFG, sd, "bf16")
    for name in ("model.norm.weight", "model.layers.0.self_attn.bogus.weight", "lm_head.weight"):
        assert name in str(e.value)
    assert not (tmp_path / "w").exists() and _leftovers(tmp_path) == []


def test_writer_stream_error_leaves_nothing(tmp_path, weights):
    def stream():
        for i, (name, t) in enumerate(weights.items()):
            yield name, (t[:-1] if i == 200 else t)

    with pytest.raises(CheckpointError, match="mis-shaped tensor"):
        write_checkpoint(tmp_path / "w", CFG, stream(), "fp8", max_shard_bytes="1MB")
    assert not (tmp_path / "w").exists() and _leftovers(tmp_path) == []
    *names, last = list(weights)
    with pytest.raises(CheckpointError, match=f"1 tensors missing: {re.escape(last)}$"):
        write_checkpoint(tmp_path / "w", CFG, ((n, weights[n]) for n in names), "bf16")
    assert not (tmp_path / "w").exists() and _leftovers(tmp_path) == []


def test_writer_refuses_nonempty_dir_unless_force(tmp_path, weights):
    out = tmp_path / "w"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        write_checkpoint(out, CFG, weights, "bf16")
    with pytest.raises(FileExistsError, match="holds no config.json"):
        write_checkpoint(out, CFG, weights, "bf16", force=True)
    assert (out / "notes.txt").read_text() == "mine"
    shutil.rmtree(out)
    out.mkdir()  # an empty directory is fine
    write_checkpoint(out, CFG, weights, "bf16")
    write_checkpoint(out, CFG, weights, "fp8", force=True)  # replaces a previous checkpoint
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert _leftovers(tmp_path) == []
    assert CheckpointReader(out).stored["model.layers.0.self_attn.wq_a.weight"][1] == FP8_DTYPE
