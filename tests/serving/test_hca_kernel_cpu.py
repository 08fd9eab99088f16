"""The backend's opt-in Triton HCA attention path equals the torch twin (Triton interpreter on CPU, a
subprocess so that TRITON_INTERPRET=1 is set before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3"])
def test_triton_hca_path_equals_twin(kv):
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).with_name("hca_kernel_check.py")
    r = subprocess.run(
        [sys.executable, str(script), kv, "cpu"], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["max_abs"] <= 0.01 * res["scale"], res  # bf16 output of the kernel
