"""Test-only (tests/serving/test_hicache_cpu.py puts this folder on the PYTHONPATH of its ECHO + HiCache CPU server).

Python imports one `sitecustomize` per process, so that server loads the two shims it needs from here, each
unchanged: tests/serving/hicache_host_shim (SGLang's 10 GiB host-memory reserve lowered for the test's host pools)
and tests/echo/cpu_spec_shim (SGLang's EAGLE tree build and greedy verify through its Triton versions). Nothing of
its own."""

from pathlib import Path

from ernie55_shim_lib import load_shims

_TESTS = Path(__file__).resolve().parents[2]

load_shims(_TESTS / "serving" / "hicache_host_shim" / "sitecustomize.py", _TESTS / "echo" / "cpu_spec_shim" / "sitecustomize.py")
