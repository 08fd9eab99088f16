"""SGLANG_ERNIE55_LAYER_IMPL on the GPU: the per-layer kernels vs the torch math at the tiny and the real
widths (layer_impl_check.run_pieces: each layer kind with a recording attention stub, T in {0, 1, 3, 19,
130}; fp32 weights; tolerance 1e-4 of scale on the GPU: Triton's approximate rsqrt / exp vs torch's), the
model end to end (tiny), the attention output in FlashMLA's bf16 form against the fp32 form (layer output bit
for bit), and the decode step's three layers captured in a CUDA graph per compute: replay = eager exactly, with
the replay time of each compute printed (the work outside attention)."""

from __future__ import annotations

import json

import pytest

from tests.serving import layer_impl_check as lc

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("geometry", ["tiny", "full"])
def test_layers_on_kernels_equal_torch_gpu(geometry):
    rep = lc.run_pieces("cuda", 1e-4, geometry)
    print(json.dumps({k: rep[k] for k in ("geometry", "worst_rel", "near_tie_tokens", "route")}))


def test_model_with_layers_on_kernels_gpu():
    rep = lc.run_model("cuda")
    print(json.dumps(rep))
    for name in ("triton_vs_torch", "triton_vs_reference"):
        assert rep[name]["max_logit_diff"] <= 1e-3, rep
        assert rep[name]["top1_equal"] >= rep["positions"] - 1, rep  # a routing / DSA near-tie may flip one


@pytest.mark.parametrize("geometry", ["tiny", "full"])
def test_flashmla_bf16_output_gives_the_fp32_outputs_layer_gpu(geometry):
    rep = lc.run_bf16_out("cuda", geometry)
    print(json.dumps(rep))
    assert rep["all_equal"], rep


@pytest.mark.slow
def test_decode_layers_capture_in_a_cuda_graph():
    rep = lc.run_graph("full")
    print(json.dumps(rep))
    for B, r in rep["batches"].items():
        assert r["replay_vs_eager"] == {"torch": 0.0, "triton": 0.0}, (B, r)
