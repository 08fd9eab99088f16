"""SGLANG_ERNIE55_LAYER_IMPL: the model's per-layer compute outside attention (mHC sites + hc_head, MoE
routing, fp32 RMSNorms, RoPE) on the Triton kernels vs the torch math, and the variable's errors.

The kernel comparisons run in Triton's CPU interpreter in a subprocess (layer_impl_check.py: TRITON_INTERPRET
must be set before Triton decorates the kernels), tiny config, fp32 weights, fresh random inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.serving import twin_harness as th

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the check runs as a module of `tests`
CHECK = ["-m", "tests.serving.layer_impl_check"]
VAR = "SGLANG_ERNIE55_LAYER_IMPL"


def run_check(*args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    for k in (
        VAR,
        "SGLANG_ERNIE55_ATTN_IMPL",
        "MASTER_PORT",
        "MASTER_ADDR",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, *CHECK, *args], env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_layer_impl_values(monkeypatch):
    from sglang_ernie55.envs import layer_impl
    from sglang_ernie55.layers.impl import use_kernels

    monkeypatch.delenv(VAR, raising=False)
    assert layer_impl() == "auto"
    assert not use_kernels(torch.zeros(1))  # auto: torch on CPU tensors
    monkeypatch.setenv(VAR, " Torch ")
    assert layer_impl() == "torch" and not use_kernels(torch.zeros(1))
    monkeypatch.setenv(VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_kernels(torch.zeros(1))  # forced, under the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=f"{VAR}=triton: a tensor on cpu and no Triton interpreter"):
        use_kernels(torch.zeros(1))


@pytest.mark.parametrize("bad", ["cuda", "kernels", "1"])
def test_layer_impl_bad_value_is_refused(monkeypatch, bad):
    """A bad value raises ValueError naming the variable and the legal values: at the first use and when
    the model is built (a server fails at start-up, not at its first forward)."""
    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.envs import layer_impl
    from sglang_ernie55.layers.impl import use_kernels

    monkeypatch.setenv(VAR, bad)
    msg = f"{VAR}='{bad}': legal values are auto, torch, triton"
    with pytest.raises(ValueError, match=msg):
        layer_impl()
    with pytest.raises(ValueError, match=msg):
        use_kernels(torch.zeros(1))
    with pytest.raises(ValueError, match=msg):
        th.build_model(tiny_config(), dtype=torch.float32)


# tensors a layer kind records: R', the stub's q, k, v, then cs, attn_sink (HCA) or index_q / w / k (MLA-DSA)
HCA_SEEN, MLA_SEEN = 6, 7


@pytest.mark.slow
@pytest.mark.parametrize(
    "geometry, per_t",
    [("tiny", HCA_SEEN + MLA_SEEN + HCA_SEEN + 1), ("odd", MLA_SEEN + HCA_SEEN + MLA_SEEN + 1)],
)
def test_layers_on_kernels_equal_torch(geometry, per_t):
    """Each decoder layer kind (tiny: dense + HCA, MLA-DSA + MoE, HCA + MoE; odd: dense + MLA-DSA, HCA + MoE,
    MLA-DSA + MoE) with a recording attention stub, T in {0, 1, 3, 19, 130}, fresh random streams / positions:
    the layer output R' and every tensor handed to the attention (q, k, v, cs, indexer qI / w / kI), and
    hc_head, within 1e-5 of their scale (fp32; measured worst 7.5e-7 tiny, 7.6e-7 odd); MoE routes: ids
    exactly equal (random inputs, and routers with exact three-way ties where the top-k boundary cuts a tie:
    the lowest ids are taken), weights to 1e-5. `odd` is issue 13's kind of geometry (layer_impl_check.ODD:
    widths no tile divides, 12 heads, RoPE 32, window / ratio 64, 3 routers choosing 7 of 8 experts)."""
    rep = run_check("pieces", "cpu", geometry)
    assert len(rep["layers"]) == 5 * per_t
    assert rep["near_tie_tokens"] == 0  # every token of every layer routed to the same experts
    assert rep["route"]["ties_rows_cut"] > 0
    print(json.dumps({"worst_rel": rep["worst_rel"], "route": rep["route"]}))


@pytest.mark.slow
def test_model_on_kernels_at_odd_geometry():
    """The model end to end at layer_impl_check.ODD with the layers on the kernels (interpreter) vs on torch
    vs the reference (fp32 pool, the backend's torch twin: what serves this geometry on the GPU too): chunked
    prefill crossing compression blocks of 64, 3 decode steps; logits to 1e-4 (measured 4.3e-6), same top-1 at
    every position. (The tiny geometry: test_model_cpu.py.)"""
    rep = run_check("model", "cpu", "odd")
    print(rep)
    for name in ("triton_vs_torch", "triton_vs_reference", "torch_vs_reference"):
        assert rep[name]["max_logit_diff"] <= 1e-4, rep
        assert rep[name]["top1_equal"] == rep["positions"], rep


@pytest.mark.slow
def test_each_post_hands_the_next_site_its_mix():
    """SGLANG_ERNIE55_MHC_MIX=fused at 300 tokens: the model's four layers and hc_head (recording attention
    stubs) run each site's post as `hc_post_mix`, 2 per layer (the last one's mix goes to hc_head), and give
    the hidden state and the streams of the cuBLAS mix and of torch to fp32 rounding (1e-5 of their scale;
    measured 1.1e-6 / 1.4e-6)."""
    rep = run_check("post_mix", "cpu", "tiny")
    assert rep["post_mix_calls"] == [rep["T"]] * (2 * rep["layers"]) and rep["calls_after"] == 0, rep
    for k in (
        "fused_vs_cublas_hidden",
        "fused_vs_cublas_streams",
        "fused_vs_torch_hidden",
        "fused_vs_torch_streams",
    ):
        assert rep[k] < 1e-5, rep


@pytest.mark.parametrize("geometry", ["tiny", "odd"])
def test_flashmla_bf16_output_gives_the_fp32_outputs_layer(geometry):
    """The backend hands an HCA / MLA-DSA layer FlashMLA's own bf16 output (a head slice of a head-padded buffer,
    as `kernel_path._flashmla` returns it) or the same values in fp32 (the Triton kernels' output): with bf16
    weights the layer's output R' is the same bit for bit, T in {1, 3, 19}, on the torch math and on the kernels
    (the interpreter with the GPU's fp32 -> bf16 rounding, tests/shim_lib/triton_bf16.py)."""
    rep = run_check("bf16_out", "cpu", geometry)
    assert len(rep["layers"]) == 2 * 3 * 2, rep  # attention kinds x T x computes
    assert rep["all_equal"], rep


def test_forced_kernels_load_on_cpu_then_move(monkeypatch):
    """SGLANG_ERNIE55_LAYER_IMPL=triton without the interpreter: a model loaded on the CPU (and moved to the GPU
    later, as tests/serving/test_layer_impl_gpu.py does) loads; the post-load router matrix is built, the
    routers are its views (fp32 in this fp32 model), and the values are the checkpoint's (the H200 run of
    2026-12-03 refused the CPU load)."""
    import torch

    from sglang_ernie55.layers.moe import Ernie55LatentMoE
    from sglang_ernie55.reference.model import build_reference
    from tests.serving import layer_impl_check as lc

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SGLANG_ERNIE55_LAYER_IMPL", "triton")
    cfg = lc.geometry_config("tiny")
    ref = build_reference(cfg, seed=0)
    model = th.build_model(cfg, dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    sd = ref.state_dict()
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, Ernie55LatentMoE)]
    assert moes
    for name, m in moes:
        cat = m._router_cat
        assert cat is not None and cat.dtype == torch.float32
        for r, lin in enumerate(m.routers):
            assert lin.weight.data_ptr() == cat[r * cfg.n_routed_experts].data_ptr()
            torch.testing.assert_close(lin.weight, sd[f"{name}.routers.{r}.weight"].float(), rtol=0, atol=0)


@pytest.mark.slow
def test_geometry_diag_runs_on_cpu():
    """tests/serving/geometry_diag.py (issue 13's GPU diagnosis) in its CPU mode, at the user's geometry: the
    torch layers + fp32 twin experts over a bf16 pool equal the bf16-KV oracle at every position (what the CPU
    server scores), and the host floor with FusedMoE's fp32-activation rounding emulated is reported."""
    env = dict(os.environ)
    for k in (VAR, "TRITON_INTERPRET", "MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "tests.serving.geometry_diag",
        "--device",
        "cpu",
        "--geometries",
        "user",
        "--lengths",
        "150,300",
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("GEOMETRY_DIAG_JSON "))
    g = json.loads(line.split(" ", 1)[1])["workers"]["default"]["geometries"]["user"]["variants"]
    twin = g["torch/twin"]
    assert twin["top1"] == twin["positions"] == 2 * 4 + 150 + 300 and twin["flips"] == 0, twin
    assert "top1" in g["host:emulated tf32trunc+fp16"], g
