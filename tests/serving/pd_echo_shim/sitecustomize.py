"""Test-only (tests/serving/test_pd_cpu.py puts this folder on the PYTHONPATH of its ECHO PD CPU servers).

Python imports one `sitecustomize` per process, so those servers load the two shims they need from here, each
unchanged: tests/serving/pd_cpu_shim (SGLang's PD prefill send kept off CUDA events) and tests/echo/cpu_spec_shim
(SGLang's EAGLE tree build and greedy verify through its Triton versions). Nothing of its own."""

from pathlib import Path

from ernie55_shim_lib import load_shims

_TESTS = Path(__file__).resolve().parents[2]

load_shims(_TESTS / "serving" / "pd_cpu_shim" / "sitecustomize.py", _TESTS / "echo" / "cpu_spec_shim" / "sitecustomize.py")
