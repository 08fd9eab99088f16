"""The built wheel installed into a folder of its own, and Python run with that folder first on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def install(wheel: Path, tmp_path: Path) -> Path:
    """pip-installs `wheel` (no dependencies) into tmp_path / "site" and returns that folder."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return target


def run_python(target: Path, code: str) -> subprocess.CompletedProcess:
    """`python -c code` in target's parent folder with the installed wheel first on the path (before the
    editable checkout)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=target.parent,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
