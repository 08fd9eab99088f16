"""Fused-MoE kernel configs (sglang_ernie55/kernels/moe_configs): SGLang's own lookup, with the ledger's hook
applied the way SGLang's HookRegistry applies it, returns our file for ERNIE-5.5 at a matching E / N / dtype /
device name and SGLang's own answer otherwise; every shipped file is one SGLang's lookup and kernel take; the
wheel ships the files; benchmarks/tune_fused_moe.py names and installs files that the lookup finds."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton

from sglang_ernie55 import patches
from sglang_ernie55.configuration import tiny_config
from sglang_ernie55.kernels import moe_configs
from tests.kernels.kutil import write_config as write

ROOT = Path(__file__).resolve().parents[2]
FMC = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"
H200 = "NVIDIA H200"
FP8_TP1 = "E=512,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
BF16_TP1 = "E=512,N=2048,device_name=NVIDIA_H200.json"
MARK = 9000  # GROUP_SIZE_M values no tuner writes: they identify our file's entries


def marked(*batch_sizes: int) -> dict:
    return {
        str(m): dict(
            BLOCK_SIZE_M=16,
            BLOCK_SIZE_N=64,
            BLOCK_SIZE_K=128,
            GROUP_SIZE_M=MARK + m,
            num_warps=4,
            num_stages=3,
        )
        for m in batch_sizes
    }


@pytest.fixture
def lookup(monkeypatch, tmp_path):
    """SGLang's config lookup with our hook on it, over an empty temporary config folder (each test writes the
    files it needs; the shipped ones would answer in their place), on an H200, serving ERNIE-5.5
    (`served.hf_config` can be swapped), deterministic inference off."""
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    folder = tmp_path / "moe_configs"
    folder.mkdir()
    monkeypatch.setattr(moe_configs, "CONFIG_DIR", folder)
    monkeypatch.setattr(fmc, "get_device_name", lambda: H200)
    flags = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(fmc, "get_exec", lambda: flags)
    served = SimpleNamespace(hf_config=tiny_config())
    monkeypatch.setattr(runtime_context, "process_model_config", lambda: served)
    # SGLang's cached lookup itself, also when an earlier test in this process applied the plugin's hooks
    # (HookRegistry wraps the module attribute; functools.wraps keeps the cached function as __wrapped__)
    own = inspect.unwrap(fmc.get_moe_configs, stop=lambda f: hasattr(f, "cache_clear"))
    (row,) = [r for r in patches.LEDGER if r.target == f"{FMC}:get_moe_configs"]
    monkeypatch.setattr(fmc, "get_moe_configs", _wrap_fn(own, row.function(), HookType[row.kind.name]))
    own.cache_clear()
    moe_configs._resolve.cache_clear()
    yield SimpleNamespace(
        fmc=fmc,
        own=own,
        served=served,
        flags=flags,
        folder=folder,
        here=folder / moe_configs.version_dir(triton.__version__),
    )
    own.cache_clear()
    moe_configs._resolve.cache_clear()


# ------------------------------------------------------------------------------------------- lookup
@pytest.mark.parametrize(
    "name, dtype, block",
    [(FP8_TP1, "fp8_w8a8", [128, 128]), (BF16_TP1, None, None)],
    ids=["fp8", "bf16"],
)
def test_our_file_answers_sglangs_lookup_for_ernie55(lookup, name, dtype, block):
    bn, bk = block or (0, 0)
    assert lookup.fmc.get_config_file_name(512, 2048, dtype, [bn, bk]) == name
    assert lookup.own(512, 2048, dtype, bn, bk) is None  # SGLang alone has nothing for this shape
    write(lookup.here, name, marked(1, 8, 4096))
    got = lookup.fmc.get_moe_configs(512, 2048, dtype, bn, bk)
    assert sorted(got) == [1, 8, 4096] and got[8]["GROUP_SIZE_M"] == MARK + 8
    # what the Triton runner asks at M = 6: the nearest batch size, and for the down projection the same entry
    # (no `_down` file: SGLang's fallback asks the hooked lookup again)
    cfg, (down, _) = lookup.fmc.try_get_optimal_moe_config(
        (512, 4096, 2048), (512, 2048, 2048), 10, dtype, 6, block_shape=block, return_down_config=True
    )
    assert cfg["GROUP_SIZE_M"] == MARK + 8 and down["GROUP_SIZE_M"] == MARK + 8
    assert lookup.fmc.try_get_optimal_moe_config(
        (512, 4096, 2048), (512, 2048, 2048), 10, dtype, 3000, block_shape=block
    )["GROUP_SIZE_M"] == (MARK + 4096)


@pytest.mark.parametrize(
    "E, N, dtype, bn, bk, sglang_has_one",
    [
        (512, 256, None, 0, 0, True),  # SGLang ships this name (another model's geometry)
        (512, 1024, "fp8_w8a8", 128, 128, False),
        (512, 2048, None, 0, 0, False),  # our file is for fp8 only
        (256, 2048, "fp8_w8a8", 128, 128, False),
    ],
)
def test_other_names_get_sglangs_own_answer(lookup, E, N, dtype, bn, bk, sglang_has_one):
    write(lookup.here, FP8_TP1, marked(1))
    expected = lookup.own(E, N, dtype, bn, bk)
    assert (expected is not None) is sglang_has_one
    assert lookup.fmc.get_moe_configs(E, N, dtype, bn, bk) == expected


def _mine(lookup) -> dict | None:
    return lookup.fmc.get_moe_configs(512, 256, None, 0, 0)


def test_another_model_gets_sglangs_answer(lookup):
    write(lookup.here, "E=512,N=256,device_name=NVIDIA_H200.json", marked(1))
    lookup.served.hf_config = SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
    got = _mine(lookup)
    assert got == lookup.own(512, 256, None, 0, 0) and got[1]["GROUP_SIZE_M"] != MARK + 1


def test_no_server_configuration_gets_sglangs_answer(lookup, monkeypatch):
    from sglang.srt import runtime_context

    def unpublished():
        raise ValueError("Global server args is not set yet!")

    monkeypatch.setattr(runtime_context, "process_model_config", unpublished)
    write(lookup.here, "E=512,N=256,device_name=NVIDIA_H200.json", marked(1))
    assert _mine(lookup) == lookup.own(512, 256, None, 0, 0)


def test_deterministic_inference_keeps_sglangs_fixed_config(lookup):
    write(lookup.here, FP8_TP1, marked(1))
    lookup.flags.deterministic.enable_deterministic_inference = True
    assert lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128) is None
    cfg = lookup.fmc.try_get_optimal_moe_config(
        (512, 4096, 2048), (512, 2048, 2048), 10, "fp8_w8a8", 1, block_shape=[128, 128]
    )
    assert cfg == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


def test_running_tritons_folder_first_then_the_newest_other(lookup, caplog):
    write(lookup.folder / "triton_0_9_0", FP8_TP1, marked(1))
    write(lookup.folder / "triton_0_10_0", FP8_TP1, marked(2))
    with caplog.at_level(logging.WARNING, logger=moe_configs.__name__):
        assert sorted(lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128)) == [2]  # 0.10 > 0.9
    assert "triton_0_10_0" in caplog.text and f"Triton {triton.__version__}" in caplog.text
    write(lookup.here, FP8_TP1, marked(4))
    moe_configs._resolve.cache_clear()
    assert sorted(lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128)) == [4]


def test_answers_are_cached_per_arguments(lookup):
    path = write(lookup.here, FP8_TP1, marked(1))
    first = lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128)
    path.unlink()  # the runner asks at every forward; the file is read once
    assert lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128) is first


# ------------------------------------------------------------------------------------------- files
def _good(tmp_path) -> Path:
    return write(tmp_path / "triton_3_6_0", FP8_TP1, {"1": marked(1)["1"] | {"GROUP_SIZE_M": 1}})


def test_check_file_takes_a_good_file_and_names_each_fault(tmp_path):
    assert moe_configs.check_file(_good(tmp_path)) == []
    # the block keys are parameters of SGLang's kernel, so a renamed one would fail every file
    assert set(moe_configs.BLOCK_KEYS) <= moe_configs.kernel_params()
    entry = json.loads(_good(tmp_path).read_text())["1"]
    faults = {
        "unknown key": {"1": entry | {"BLOCK_M": 16}},
        "missing": {"1": {k: v for k, v in entry.items() if k != "GROUP_SIZE_M"}},
        "BLOCK_SIZE_K": {"1": entry | {"BLOCK_SIZE_K": 256}},  # does not divide the 128-block
        "powers of two": {"1": entry | {"BLOCK_SIZE_N": 96}},
        "block sizes >= 16": {"1": entry | {"BLOCK_SIZE_M": 8}},
        "positive integer": {"one": entry},
    }
    for words, entries in faults.items():
        problems = moe_configs.check_file(write(tmp_path / "triton_3_6_0", FP8_TP1, entries))
        assert problems and words in " ".join(problems), (words, problems)
    assert "triton_<version>" in " ".join(
        moe_configs.check_file(write(tmp_path / "configs", FP8_TP1, {"1": entry}))
    )
    assert "file-name" in " ".join(moe_configs.check_file(write(tmp_path / "triton_3_6_0", "E=512.json", {})))


@pytest.mark.parametrize("path", moe_configs.shipped_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_file_is_valid_and_named_as_sglang_names_it(path, monkeypatch):
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc

    assert moe_configs.check_file(path) == []
    m = moe_configs._FILE_NAME.fullmatch(path.name)
    monkeypatch.setattr(fmc, "get_device_name", lambda: m.group(3).replace("_", " "))
    block = [int(m.group(5) or 0), int(m.group(6) or 0)]
    name = fmc.get_config_file_name(
        int(m.group(1)), int(m.group(2)), m.group(4), block, bool(m.group(7)), down_moe=bool(m.group(8))
    )
    assert name == path.name


def test_wheel_ships_the_config_files(tmp_path):
    src = tmp_path / "project"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "sglang_ernie55", src / "sglang_ernie55", ignore=shutil.ignore_patterns("__pycache__")
    )
    folder = src / "sglang_ernie55" / "kernels" / "moe_configs" / "triton_3_6_0"
    write(folder, FP8_TP1, marked(1))
    linear = "N=2048,K=4096,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
    write(src / "sglang_ernie55" / "kernels" / "fp8_linear_configs" / "triton_3_6_0", linear, marked(1))
    shipped = [
        f"sglang_ernie55/kernels/moe_configs/{p.parent.name}/{p.name}" for p in moe_configs.shipped_files()
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("sglang_ernie55-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert f"sglang_ernie55/kernels/moe_configs/triton_3_6_0/{FP8_TP1}" in names
    assert "sglang_ernie55/kernels/moe_configs/__init__.py" in names
    assert f"sglang_ernie55/kernels/fp8_linear_configs/triton_3_6_0/{linear}" in names
    assert set(shipped) <= names


# ------------------------------------------------------------------------------------------- the tuner
@pytest.fixture(scope="module")
def tuner():
    """benchmarks/tune_fused_moe.py as a module (its `plan` and `install` need no GPU)."""
    spec = importlib.util.spec_from_file_location("tune_fused_moe", ROOT / "benchmarks" / "tune_fused_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_tuner_shapes_are_the_servers_and_the_h200_cells(tuner):
    shapes = tuner.model_shapes(H200)
    got = [(s.precision, s.E, s.N, s.K, s.topk, s.tp) for s in shapes]
    # TP 1 (one-GPU server) in both precisions, then the H200 cells: FP8 at TP 4, BF16 at TP 8
    assert got == [
        ("fp8", 512, 2048, 2048, 10, 1),
        ("bf16", 512, 2048, 2048, 10, 1),
        ("fp8", 512, 512, 2048, 10, 4),
        ("bf16", 512, 256, 2048, 10, 8),
    ]
    assert [s.file_name(H200) for s in shapes[:2]] == [FP8_TP1, BF16_TP1]


def test_tuner_search_space_is_one_sglangs_kernel_takes(tuner, tmp_path):
    for shape in tuner.model_shapes(H200):
        elt = 1 if shape.precision == "fp8" else 2
        for M in tuner.BATCH_SIZES:
            cands = tuner.candidates(shape, M)
            assert cands, (shape.label, M)
            bms = {c["BLOCK_SIZE_M"] for c in cands}
            # small batches: 16-row tiles only (an expert gets a row or two); large: no 16-row tiles
            assert bms == {16} if M <= 256 else (16 not in bms if M >= 2048 else max(bms) > 16)
            for c in cands:
                assert tuner.smem(
                    c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], elt, c["num_stages"]
                ) <= (tuner.SMEM_BYTES)
            path = write(
                tmp_path / "triton_3_6_0", shape.file_name(H200), {str(i + 1): c for i, c in enumerate(cands)}
            )
            assert moe_configs.check_file(path) == []


def _bundle(tuner, complete=True, entry=None) -> dict:
    shapes = tuner.model_shapes(H200)[:2]
    cfg = entry or tuner.full_config(
        dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)
    )
    return dict(
        device_name=H200,
        triton=triton.__version__,
        folder=moe_configs.version_dir(triton.__version__),
        shapes=[
            dict(file=s.file_name(H200), complete=complete or i == 0, configs={"1": cfg, "64": cfg}, rows=[])
            for i, s in enumerate(shapes)
        ],
    )


def test_tuner_install_writes_files_the_lookup_returns(tuner, lookup, tmp_path, capsys):
    bundle = tmp_path / "tune_fused_moe.json"
    bundle.write_text(json.dumps(_bundle(tuner, complete=False)))
    assert tuner.main(["install", str(bundle), "--dest", str(lookup.folder)]) == 0
    out = capsys.readouterr().out
    assert f"skip {BF16_TP1}: incomplete" in out  # a shape whose M list did not finish is not installed
    assert not (lookup.here / BF16_TP1).exists()
    text = (lookup.here / FP8_TP1).read_text()
    assert text.startswith('{\n    "1": {\n        "BLOCK_SIZE_M": 16,')  # SGLang's own layout
    got = lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128)
    assert sorted(got) == [1, 64] and got[64]["BLOCK_SIZE_N"] == 128 and got[64]["num_warps"] == 4
    bad = tuner.full_config(dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=256, GROUP_SIZE_M=1))
    bundle.write_text(json.dumps(_bundle(tuner, entry=bad)))
    assert tuner.main(["install", str(bundle), "--dest", str(tmp_path / "other")]) == 1
    assert "INVALID" in capsys.readouterr().out


def test_tuner_install_merges_a_bundle_of_a_few_batch_sizes(tuner, lookup, tmp_path, capsys):
    bundle = tmp_path / "tune_fused_moe.json"
    bundle.write_text(json.dumps(_bundle(tuner)))
    assert tuner.main(["install", str(bundle), "--dest", str(lookup.folder)]) == 0
    wide = tuner.full_config(dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=256, BLOCK_SIZE_K=128, GROUP_SIZE_M=16))
    part = _bundle(tuner, entry=wide)
    for sh in part["shapes"]:
        sh["configs"] = {"8192": wide}
    bundle.write_text(json.dumps(part))
    capsys.readouterr()
    assert tuner.main(["install", str(bundle), "--dest", str(lookup.folder)]) == 0
    assert "rows for M 1, 64 (not in the bundle" in capsys.readouterr().out
    got = lookup.fmc.get_moe_configs(512, 2048, "fp8_w8a8", 128, 128)
    assert sorted(got) == [1, 64, 8192] and got[8192]["BLOCK_SIZE_N"] == 256 and got[1]["BLOCK_SIZE_M"] == 16
    # --replace: the bundle's rows alone
    assert tuner.main(["install", str(bundle), "--dest", str(lookup.folder), "--replace"]) == 0
    assert sorted(json.loads((lookup.here / FP8_TP1).read_text())) == ["8192"]
    # an invalid bundle leaves the merged file as it was
    before = (lookup.here / FP8_TP1).read_text()
    bad = tuner.full_config(dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=256, GROUP_SIZE_M=1))
    bundle.write_text(json.dumps(_bundle(tuner, entry=bad)))
    assert tuner.main(["install", str(bundle), "--dest", str(lookup.folder)]) == 1
    assert (lookup.here / FP8_TP1).read_text() == before
