"""The README's two commands work from any directory: `scripts/test.sh` finds pytest (installing the test
extra first when it is missing) and `scripts/quickstart.sh` reaches the demo; arguments pass through."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "scripts" / name), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_test_sh_from_another_directory(tmp_path):
    p = run_script("test.sh", "--version", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pytest" in p.stdout + p.stderr and "[test] installing" not in p.stdout


def test_quickstart_sh_from_another_directory(tmp_path):
    p = run_script("quickstart.sh", "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("usage: sglang-ernie55 demo") and "--max-total-tokens 8192" in p.stdout
