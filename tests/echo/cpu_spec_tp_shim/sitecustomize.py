"""Test-only (tests/echo/test_echo_server_cpu.py puts this folder on the PYTHONPATH of its multi-rank CPU server).

Python imports one `sitecustomize` per process, so an ECHO server with several CPU ranks (attention DP) loads the
two shims it needs from here, each unchanged: tests/serving/cpu_tp_shim (SGLang's multi-rank CPU limits: gloo
instead of PyNccl, the DP-attention copies and gathers) and tests/echo/cpu_spec_shim (SGLang's EAGLE tree build and
greedy verify through its Triton versions). Nothing of its own."""

from pathlib import Path

from ernie55_shim_lib import load_shims

_TESTS = Path(__file__).resolve().parents[2]

load_shims(_TESTS / "serving" / "cpu_tp_shim" / "sitecustomize.py", _TESTS / "echo" / "cpu_spec_shim" / "sitecustomize.py")
