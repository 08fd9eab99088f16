"""The `ernie55` backend's kernel path (Triton, in Triton's CPU interpreter: a subprocess, so that
TRITON_INTERPRET=1 is set before triton is imported) against its torch twin, tiny geometry, bf16 and fp8
pools, and rows of the geometry matrix the tiny preset never takes (other windows / compress ratios, widths
that are not powers of two). The scenarios and criteria are in kernel_path_check.py (the GPU suite runs the
same at full width)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the check runs as a module of `tests`
CHECK = ["-m", "tests.serving.kernel_path_check"]


def _run(*args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    # the check opens its own world-1 group: not on the port this test process may already hold
    for k in ("SGLANG_ERNIE55_ATTN_IMPL", "MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, *CHECK, *args], env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_kernel_path_equals_twin_in_the_backend(kv):
    """Mixed extend (a block completed from state rows, two from batch rows, a page crossed), a prefix hit
    into a slot with stale state, batched decode completing a block, a graph-width decode with a padded row:
    outputs to fp32 rounding (1e-5 of their scale), stored rows and open-block state byte for byte."""
    rep = _run("backend", kv, "cpu", "tiny", "triton")
    assert set(rep["steps"]) == {
        "mixed_extend",
        "short_prefill",
        "prefix_hit",
        "decode0",
        "decode1",
        "decode2",
        "graph_decode_padded",
    }
    assert rep["fused_meta"] == {"triton": True}  # decode rows from the fused build (kernels/decode_meta.py)
    assert rep["fused_topk"] == {
        "triton": True
    }  # MLA-DSA keys from the one-launch top-k (kernels/indexer.py)
    print(json.dumps(rep))


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_hca_sparse_prefill_rows_equal_twin(kv):
    """The same batches with the HCA layers' extend rows on the sparse-prefill path (the batch's window and
    compressed rows copied to bf16 once per layer, one index row per query over both; FlashMLA's kernel
    stood in for by its definition in torch, `kernel_path_check.fake_sparse_prefill`): outputs to fp32
    rounding, the three extend batches through the copy (a prefix hit included), the sink passed."""
    rep = _run("backend_hca_prefill", kv, "cpu", "tiny")
    assert rep["hca_sparse_prefill"] == {"triton": True} and len(rep["steps"]) == 7, rep
    calls = rep["hca_prefill_calls"]
    assert [c[0][0] for c in calls] == [363, 30, 12] and all(c[3] for c in calls), calls


@pytest.mark.slow
def test_kernel_path_several_indexer_rows_equal_twin(monkeypatch):
    """The same batches with the indexer logits' extend launch set by SGLANG_ERNIE55_INDEXER_EXTEND to 4 query
    rows per program (keys major): extend batches of several requests, groups across a request boundary."""
    monkeypatch.setenv("SGLANG_ERNIE55_INDEXER_EXTEND", "32,4,1,4")
    rep = _run("backend", "fp8_e4m3", "cpu", "tiny", "triton")
    assert rep["index_extend"] == {"triton": [[32, 4, True, True, 4]]}, rep["index_extend"]
    assert {"mixed_extend", "short_prefill", "prefix_hit"} <= set(rep["steps"])


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_kernel_path_verify_equals_twin(kv):
    """TARGET_VERIFY (4 rows per request) on the two-block state ring: rows crossing a compression block
    and a page, rejected drafts re-verified over the same slots, the graph form with a padded request."""
    rep = _run("backend_verify", kv, "cpu", "tiny", "triton")
    assert set(rep["steps"]) == {"verify_cross_block", "verify_after_reject", "verify_graph_padded"}
    assert rep["fused_meta"] == {"triton": True}
    assert rep["fused_topk"] == {"triton": True}


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_zero_token_extend_changes_nothing(kv):
    """An EXTEND batch in which a request brings no new token (its prefix mid-block, at a block boundary, past
    index_topk; between, before and after live requests): the twin and the kernel path give the outputs and
    the pool of the same batch without it; a batch of no tokens returns zero rows and writes nothing."""
    rep = _run("backend_zero_extend", kv, "cpu", "tiny", "triton")
    assert set(rep["steps"]) == {"zero_between", "zero_first_and_last", "all_zero"}
    for tag in ("zero_between", "zero_first_and_last"):
        assert set(rep["steps"][tag]) == {"triton", "twin_vs_without", "triton_vs_without"}, rep["steps"][tag]
    assert set(rep["steps"]["all_zero"]) == {"twin", "triton"}
    print(json.dumps(rep))


BACKEND_STEPS = {
    "mixed_extend",
    "short_prefill",
    "prefix_hit",
    "decode0",
    "decode1",
    "decode2",
    "graph_decode_padded",
}
# geometry-matrix rows (tests/serving/geometries.py) and KV dtypes: window 64 / ratio 32, head 96 / rope 32,
# MLA latent 96 + rope 32, indexer 48, v_head 48, MLA-DSA first (bf16: the fp8 layout cannot tile latent 96);
# window 32 < ratio 128, head 96 / rope 32 (nope 64: fp8 fits too), HCA layers only
MATRIX = [("odd_mla_dims", "bfloat16"), ("w32_c128_hca_only", "bfloat16"), ("w32_c128_hca_only", "fp8_e4m3")]
MATRIX_IDS = [f"{g}-{kv}" for g, kv in MATRIX]


@pytest.mark.slow
@pytest.mark.parametrize("geometry,kv", MATRIX, ids=MATRIX_IDS)
def test_kernel_path_equals_twin_at_other_geometries(geometry, kv):
    """The backend scenario above (mixed extend completing blocks from state rows, a short prefill, a prefix hit,
    batched decode, a graph-width decode with a padded row) at a geometry the kernels hold padded and a window /
    compress ratio other than 128 / 128: same criteria (outputs to 1e-5 of their scale, stored rows and open-block
    state byte for byte, compressed entries by value)."""
    rep = _run("backend", kv, "cpu", geometry, "triton")
    assert set(rep["steps"]) == BACKEND_STEPS
    kinds = {k[:3] for s in rep["steps"].values() for k in s["triton"] if k.endswith("_scale")}
    assert kinds == ({"hca", "mla"} if geometry == "odd_mla_dims" else {"hca"}), kinds


@pytest.mark.slow
@pytest.mark.parametrize("geometry,kv", MATRIX, ids=MATRIX_IDS)
def test_kernel_path_verify_equals_twin_at_other_geometries(geometry, kv):
    """TARGET_VERIFY (4 rows per request) on the two-block state ring at the same geometries: rows crossing a
    compression block, rejected drafts re-verified, the graph form with a padded request."""
    rep = _run("backend_verify", kv, "cpu", geometry, "triton")
    assert set(rep["steps"]) == {"verify_cross_block", "verify_after_reject", "verify_graph_padded"}


@pytest.mark.slow
def test_kernel_path_equals_twin_over_the_swa_pool():
    """The hybrid pool under SGLang's SWATokenToKVPoolAllocator after an out-of-window eviction (a request
    whose window slots are not its full slots): extend, decode, graph-width decode with a padded row."""
    rep = _run("backend_swa", "bfloat16", "cpu", "tiny", "triton")
    assert set(rep["steps"]) == {"swa_mixed_extend", "swa_decode0", "swa_decode1", "swa_graph_decode_padded"}


@pytest.mark.slow
def test_static_buffer_decode_steps_equal_eager():
    """The CUDA-graph decode protocol without a GPU: metadata built once per step from the same static
    buffers (3 live rows + 1 padded row, new tokens copied in, one completing a block), equal to the eager
    kernel path and to the twin, three steps (the GPU test replays a captured graph instead)."""
    rep = _run("graph", "bfloat16", "cpu", "tiny", "triton,torch")
    assert len(rep["steps"]) == 3 and all(set(s) == {"triton", "torch"} for s in rep["steps"])


@pytest.mark.slow
def test_layers_emit_queries_in_the_backends_dtype():
    """The tiny model in bf16 on the kernel path: the HCA and MLA-DSA layers hand the backend bf16 attention
    and indexer queries (rounded once where they are made: the HCA norm + RoPE launch, the MLA and indexer
    RoPE launches on the projections' bf16 rows), the same bits as fp32 queries cast by the backend, so the
    logits are the same bits too (the interpreter with the GPU's bf16 rounding, tests/shim_lib/triton_bf16.py)."""
    rep = _run("query_dtype", "bfloat16", "cpu")
    kinds = ["hca", "indexer", "mla_dsa"]
    assert rep["dtypes"]["layer"] == [[k, "torch.bfloat16"] for k in kinds], rep
    assert rep["dtypes"]["backend"] == [[k, "torch.float32"] for k in kinds], rep
    assert rep["calls"] >= 20 and rep["queries_equal"] == rep["calls"], rep
    assert rep["logits_equal"], rep


@pytest.mark.slow
def test_kernel_path_model_equals_rounded_twin():
    """The tiny model end to end (layers -> typed backend inputs -> kernels) equals the twin fed the same
    bf16-rounded queries: logits to 2e-3 of their scale, the same greedy token at every position but a
    near-tie of the twin's within the logits' measured difference (at most two: the fp32 GEMMs round as the
    host CPU's kernels do, so a position whose top two differ by 2e-5 may flip on one host)."""
    rep = _run("model", "bfloat16", "cpu")
    r = rep["rounded_twin"]
    print(json.dumps(rep))
    assert r["max_logit_diff"] <= 2e-3 * r["logit_scale"], rep
    assert r["top1_equal"] >= rep["positions"] - 2, rep
    assert r["top1_equal"] == rep["positions"] or r["worst_top1_gap"] <= 2 * r["max_logit_diff"], rep
