"""Hardware cells as pytest markers (FlashInfer-style): a test declares what it needs, the session
skips it with a reason where that is absent, so the CPU suite stays green and a GPU run selects its cell.

- `@pytest.mark.gpu`       needs a CUDA GPU.
- `@pytest.mark.h200`      the H200 cell (implies gpu).
- `@pytest.mark.gpus(n)`   needs n CUDA GPUs in one host (implies gpu).
- `@pytest.mark.slow`      > ~30 s on 2 CPU cores; still part of the default suite unless `-m "not slow"`.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def _gpus() -> tuple[int, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return 0, ""
        return torch.cuda.device_count(), torch.cuda.get_device_name(0)
    except Exception:  # torch missing or broken driver: no GPU cell
        return 0, ""


def pytest_collection_modifyitems(config, items):
    count, name = _gpus()
    for item in items:
        wants_gpu = any(item.get_closest_marker(m) is not None for m in ("gpu", "h200", "gpus"))
        if not wants_gpu:
            continue
        if count == 0:
            item.add_marker(
                pytest.mark.skip(
                    reason="needs a CUDA GPU and this machine has none; on a GPU machine run "
                    "`python3 -m pytest -m gpu tests` (or `bash scripts/gpu-suite.sh`)"
                )
            )
            continue
        for m in item.iter_markers("gpus"):
            need = int(m.args[0]) if m.args else 1
            if count < need:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs {need} CUDA GPUs in one machine, this machine has {count}"
                    )
                )
        if item.get_closest_marker("h200") is not None and "H200" not in name:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs an NVIDIA H200 (its numbers are the H200's); this GPU is {name!r}"
                )
            )


def pytest_runtest_logreport(report):
    """PYTEST_INSTAFAIL=1 (scripts/gpu-all.sh sets it): a failure's traceback is printed when it happens, not
    in the end-of-session summary, which a device command cut off at its time limit never reaches."""
    if report.failed and os.environ.get("PYTEST_INSTAFAIL") == "1":
        print(
            f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n",
            file=sys.stderr,
            flush=True,
        )


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """The project's wheel, built once per test session (offline, no build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parents[1]
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
            str(out),
            str(root),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (whl,) = out.glob("sglang_ernie55-*.whl")
    return whl
