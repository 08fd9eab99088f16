"""The one-launch kernels compile for the H200 (sm_90) on a machine without a GPU: the CPU suite runs them under
Triton's interpreter, which accepts code the compiler refuses (a constexpr assigned twice in an unrolled loop
did). `benchmarks/kernel_resources.py --fused` captures each launch at serving shapes and compiles it with
Triton's own specialisation; it runs in a child process because this session's Triton interprets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_one_launch_kernels_compile_for_sm90(tmp_path):
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"this Triton ({triton.__version__}) ships no CUDA toolchain ({ptxas} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "fused.json"
    p = subprocess.run(
        [sys.executable, "benchmarks/kernel_resources.py", "--fused", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    from sglang_ernie55.kernels.indexer import TOPK_CONFIGS

    topk = {
        f"indexer_topk_{kind}_{b}x{w}w" for kind in ("slots", "positions") for _r, (b, w, *_s) in TOPK_CONFIGS
    }
    topk |= {f"indexer_topk_slots_{b}x{w}w_sampled" for _r, (b, w, *_s) in TOPK_CONFIGS}
    meta = {f"decode_meta{m}_rows{r}" for m in ("", "_mapped") for r in (1, 3)}
    norms = {"rms_norm_rope_q", "rms_norm_rope_kv", "rms_norm"}
    mhc = {"hc_pre_tail", "hc_pre_tail_norm", "hc_head_norm", "hc_mix_fused", "hc_pre_tail_ss", "hc_post_mix"}
    logits = {
        "indexer_logits_extend_128x4w",
        "indexer_logits_decode_64x4w",
        "indexer_logits_extend_64x4w_km_rows4",
    }
    logits |= {"indexer_logits_extend_64x4w_km_rows2", "indexer_logits_extend_64x8w_km_rows4"}
    rope = {"rope_inverse_interleaved", "rope_neox"}
    assert set(rows) == meta | topk | norms | mhc | logits | rope
    for name, r in rows.items():
        assert r["spill_st"] == 0 and r["spill_ld"] == 0, (name, r)
