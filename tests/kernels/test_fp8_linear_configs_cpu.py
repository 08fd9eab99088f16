"""Block-FP8 Linear GEMM configs (sglang_ernie55/kernels/fp8_linear_configs): SGLang's own lookup, with the ledger's
hook applied the way SGLang's HookRegistry applies it, returns our file for ERNIE-5.5 at a matching N / K / device
name and SGLang's own answer otherwise; SGLang's Triton GEMM launches the nearest batch size's entry; `check_file`
names each fault; every shipped file is one SGLang's lookup and kernel take."""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

from sglang_ernie55 import patches
from sglang_ernie55.configuration import tiny_config
from sglang_ernie55.kernels import fp8_linear_configs as flc
from sglang_ernie55.kernels import moe_configs
from tests.kernels.kutil import write_config as write

GEMM = "sglang.kernels.ops.gemm.fp8_kernel"
FMC = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config"
H200 = "NVIDIA H200"
OURS = "N=2048,K=4096,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
MARK = 9000  # GROUP_SIZE_M values no tuner writes: they identify our file's entries


def marked(*batch_sizes: int) -> dict:
    return {
        str(m): dict(
            BLOCK_SIZE_M=16,
            BLOCK_SIZE_N=32,
            BLOCK_SIZE_K=128,
            GROUP_SIZE_M=MARK + m,
            num_warps=4,
            num_stages=4,
        )
        for m in batch_sizes
    }


@pytest.fixture
def lookup(monkeypatch, tmp_path):
    """SGLang's block-FP8 config lookup with our hook on it, over an empty temporary config folder, on an H200,
    serving ERNIE-5.5 (`served.hf_config` can be swapped), deterministic inference off."""
    from sglang.kernels.ops.gemm import fp8_kernel
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    folder = tmp_path / "fp8_linear_configs"
    folder.mkdir()
    monkeypatch.setattr(flc, "CONFIG_DIR", folder)
    monkeypatch.setattr(fp8_kernel, "get_device_name", lambda: H200)
    flags = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(fmc, "get_exec", lambda: flags)
    served = SimpleNamespace(hf_config=tiny_config())
    monkeypatch.setattr(runtime_context, "process_model_config", lambda: served)
    own = inspect.unwrap(fp8_kernel.get_w8a8_block_fp8_configs, stop=lambda f: hasattr(f, "cache_clear"))
    (row,) = [r for r in patches.LEDGER if r.target == f"{GEMM}:get_w8a8_block_fp8_configs"]
    monkeypatch.setattr(
        fp8_kernel, "get_w8a8_block_fp8_configs", _wrap_fn(own, row.function(), HookType[row.kind.name])
    )
    own.cache_clear()
    flc._resolve.cache_clear()
    yield SimpleNamespace(
        k=fp8_kernel,
        own=own,
        served=served,
        flags=flags,
        folder=folder,
        here=folder / moe_configs.version_dir(triton.__version__),
    )
    own.cache_clear()
    flc._resolve.cache_clear()


def test_our_file_answers_sglangs_lookup_for_ernie55(lookup):
    assert flc.file_name(2048, 4096, H200) == OURS
    assert lookup.own(2048, 4096, 128, 128) is None  # SGLang alone has nothing for this shape
    write(lookup.here, OURS, marked(1, 8, 4096))
    got = lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128)
    assert sorted(got) == [1, 8, 4096] and got[8]["GROUP_SIZE_M"] == MARK + 8


class _Recorder:
    """Stands in for SGLang's Triton kernel: `kernel[grid](...)` records the launch's keyword arguments."""

    def __init__(self):
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("M, entry", [(1, 1), (6, 8), (3000, 4096)])
def test_sglangs_gemm_launches_the_nearest_batch_sizes_entry(lookup, monkeypatch, M, entry):
    write(lookup.here, OURS, marked(1, 8, 4096))
    rec = _Recorder()
    monkeypatch.setattr(lookup.k, "_w8a8_block_fp8_matmul", rec)
    monkeypatch.setattr(lookup.k, "select_w8a8_block_fp8_matmul_kernel", lambda M, N, cfg: rec)
    N, K = 2048, 4096
    a = torch.zeros(M, K, dtype=torch.float8_e4m3fn)
    b = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    lookup.k.w8a8_block_fp8_matmul_triton(
        a, b, torch.ones(M, K // 128), torch.ones(N // 128, K // 128), [128, 128], torch.bfloat16
    )
    (kw,) = rec.launches
    assert kw["GROUP_SIZE_M"] == MARK + entry and kw["BLOCK_SIZE_N"] == 32


@pytest.mark.parametrize(
    "N, K, sglang_has_one",
    [
        (1536, 7168, True),
        (2048, 512, True),
        (4096, 2048, False),
    ],  # DeepSeek shapes SGLang ships; one it lacks
)
def test_other_shapes_get_sglangs_own_answer(lookup, N, K, sglang_has_one):
    write(lookup.here, OURS, marked(1))
    expected = lookup.own(N, K, 128, 128)
    assert (expected is not None) is sglang_has_one
    assert lookup.k.get_w8a8_block_fp8_configs(N, K, 128, 128) == expected


def test_another_model_gets_sglangs_answer(lookup):
    write(lookup.here, OURS, marked(1))
    lookup.served.hf_config = SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
    assert lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128) is None


def test_no_server_configuration_gets_sglangs_answer(lookup, monkeypatch):
    from sglang.srt import runtime_context

    def unpublished():
        raise ValueError("Global server args is not set yet!")

    monkeypatch.setattr(runtime_context, "process_model_config", unpublished)
    write(lookup.here, OURS, marked(1))
    assert lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128) is None


def test_deterministic_inference_keeps_sglangs_fixed_tile(lookup):
    write(lookup.here, OURS, marked(1))
    lookup.flags.deterministic.enable_deterministic_inference = True
    assert lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128) is None


def test_running_tritons_folder_first_then_the_newest_other(lookup, caplog):
    write(lookup.folder / "triton_0_9_0", OURS, marked(1))
    write(lookup.folder / "triton_0_10_0", OURS, marked(2))
    with caplog.at_level(logging.WARNING, logger=flc.__name__):
        assert sorted(lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128)) == [2]
    assert "triton_0_10_0" in caplog.text and f"Triton {triton.__version__}" in caplog.text
    write(lookup.here, OURS, marked(4))
    flc._resolve.cache_clear()
    assert sorted(lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128)) == [4]


# ------------------------------------------------------------------------------------------- files
def test_check_file_takes_good_files_and_names_each_fault(tmp_path):
    entry = marked(1)["1"] | {"GROUP_SIZE_M": 1}
    hopper = entry | {"SPLIT_K": 4, "SWAP_AB": True}
    assert flc.check_file(write(tmp_path / "triton_3_6_0", OURS, {"1": entry, "64": hopper})) == []
    assert set(flc.BLOCK_KEYS) <= flc.kernel_params(False) and set(flc.BLOCK_KEYS) <= flc.kernel_params(True)
    assert set(flc.HOPPER_KEYS) <= flc.kernel_params(True)
    faults = {
        "unknown key": {"1": entry | {"BLOCK_M": 16}},
        "missing": {"1": {k: v for k, v in entry.items() if k != "GROUP_SIZE_M"}},
        "does not divide": {"1": entry | {"BLOCK_SIZE_K": 256}},
        "powers of two": {"1": entry | {"BLOCK_SIZE_N": 96}},
        "block sizes >= 16": {"1": entry | {"BLOCK_SIZE_M": 8}},
        "SPLIT_K": {"1": entry | {"SPLIT_K": 3}},
        "SM90 kernel": {"1": entry | {"SPLIT_K": 1}},
        "true or false": {"1": entry | {"SWAP_AB": 1}},
        "positive integer": {"one": entry},
    }
    for words, entries in faults.items():
        problems = flc.check_file(write(tmp_path / "triton_3_6_0", OURS, entries))
        assert problems and words in " ".join(problems), (words, problems)
    assert "triton_<version>" in " ".join(flc.check_file(write(tmp_path / "configs", OURS, {"1": entry})))
    assert "file-name" in " ".join(flc.check_file(write(tmp_path / "triton_3_6_0", "N=1.json", {"1": entry})))


@pytest.mark.parametrize("path", flc.shipped_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_file_is_valid_and_named_as_sglang_names_it(path):
    assert flc.check_file(path) == []
    m = flc._FILE_NAME.fullmatch(path.name)
    block = (int(m.group(4)), int(m.group(5)))
    assert flc.file_name(int(m.group(1)), int(m.group(2)), m.group(3).replace("_", " "), block) == path.name


# ------------------------------------------------------------------------------------------- the tuner
@pytest.fixture(scope="module")
def tuner():
    """benchmarks/tune_fused_moe.py as a module (its `plan`, shapes, search space and `install` need no GPU)."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tune_fused_moe", root / "benchmarks" / "tune_fused_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_linear_shapes_are_every_fp8_linear_of_the_one_gpu_server(tuner):
    shapes = tuner.linear_shapes(H200)
    got = {(s.N, s.K) for s in shapes}
    # the attention output projections, HCA's wq_b, the dense FFN's gate | up and the MoE's latent down among them
    assert (4096, 8192) in got and (32768, 1024) in got and (24576, 4096) in got and (2048, 4096) in got
    assert len(got) == len(shapes) == 11
    # each (N, K) once; ordered by the bytes a decode step of the 43-layer model reads through it
    assert shapes[0].used_by == ["hca attention self_attn.wo_b", "mla_dsa attention self_attn.o_proj"]
    assert any(u.startswith("dense FFN") for s in shapes for u in s.used_by)
    assert all(s.file_name(H200) == flc.file_name(s.N, s.K, H200) for s in shapes)


def test_linear_search_space_is_one_sglangs_kernels_take(tuner, tmp_path):
    shape = tuner.LinearShape(2048, 4096)
    for M in tuner.BATCH_SIZES:
        cands = tuner.linear_candidates(shape, M)
        assert cands and len({tuner.cfg_key(c) for c in cands}) == len(cands)
        split = [c for c in cands if c.get("SPLIT_K", 1) > 1 or c.get("SWAP_AB")]
        # the SM90 split-K / swap-AB variants where few rows leave the GPU idle; each K split >= 2 tiles
        assert bool(split) is (M <= 64)
        assert all(4096 // 128 // c.get("SPLIT_K", 1) >= 2 for c in cands)
        assert all(c["BLOCK_SIZE_M"] <= max(16, 2 ** (M - 1).bit_length()) for c in cands)
        # Hopper's 256-column tile at prefill sizes only
        assert any(c["BLOCK_SIZE_N"] == 256 for c in cands) is (M >= 1024)
        path = write(
            tmp_path / "triton_3_6_0", shape.file_name(H200), {str(i + 1): c for i, c in enumerate(cands)}
        )
        assert flc.check_file(path) == [], M


@pytest.mark.parametrize("N, K, source", [(2048, 4096, "SGLang default"), (1536, 7168, "SGLang file")])
def test_linear_pick_is_what_sglang_launches(tuner, monkeypatch, N, K, source):
    from sglang.kernels.ops.gemm import fp8_kernel

    monkeypatch.setattr(fp8_kernel, "get_device_name", lambda: H200)
    own = inspect.unwrap(fp8_kernel.get_w8a8_block_fp8_configs, stop=lambda f: hasattr(f, "cache_clear"))
    own.cache_clear()
    try:
        cfg, src = tuner.linear_pick(tuner.LinearShape(N, K), 8)
        assert src == source
        if source == "SGLang file":
            table = own(N, K, 128, 128)
            want = table[min(table, key=lambda m: abs(m - 8))]
            assert all(cfg[k] == v for k, v in want.items())
        else:  # SGLang's default tile
            assert cfg == dict(
                BLOCK_SIZE_M=64,
                BLOCK_SIZE_N=128,
                BLOCK_SIZE_K=128,
                GROUP_SIZE_M=32,
                num_warps=4,
                num_stages=3,
            )
    finally:
        own.cache_clear()


def test_linear_install_writes_files_the_lookup_returns(tuner, lookup, tmp_path, capsys):
    entry = tuner.full_config(
        dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, SPLIT_K=4)
    )
    bundle = dict(
        kernel="linear",
        device_name=H200,
        triton=triton.__version__,
        folder=moe_configs.version_dir(triton.__version__),
        shapes=[dict(file=OURS, complete=True, configs={"1": entry, "64": entry}, rows=[])],
    )
    path = tmp_path / "tune_fp8_linear.json"
    path.write_text(json.dumps(bundle))
    assert tuner.main(["install", str(path), "--dest", str(lookup.folder)]) == 0
    assert flc.check_file(lookup.here / OURS) == []
    got = lookup.k.get_w8a8_block_fp8_configs(2048, 4096, 128, 128)
    assert sorted(got) == [1, 64] and got[1]["SPLIT_K"] == 4
    bundle["shapes"][0]["configs"] = {"1": entry | {"SPLIT_K": 1}}  # SPLIT_K 1 would reach the plain kernel
    path.write_text(json.dumps(bundle))
    assert tuner.main(["install", str(path), "--dest", str(tmp_path / "other")]) == 1
    assert "INVALID" in capsys.readouterr().out
