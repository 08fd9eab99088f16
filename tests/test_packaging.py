"""The wheel: the kernels ship inside the package as `sglang_ernie55.kernels` (never a top-level `kernels`, which is the PyPI
package SGLang depends on), hardware cells ship as package data, and both `kernels` packages import."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests import wheel_util

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(built_wheel) -> Path:
    return built_wheel


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("kernels/")], (
        "a top-level kernels/ would shadow PyPI's `kernels`"
    )
    assert "sglang_ernie55/kernels/__init__.py" in names
    assert any(n.startswith("sglang_ernie55/reference/") for n in names)
    cells = [n for n in names if n.startswith("sglang_ernie55/cells/") and n.endswith(".toml")]
    assert cells, "hardware cells (sglang_ernie55/cells/*.toml) must ship as package data"
    ep = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(ep[0]).decode()
    assert "[sglang.srt.plugins]" in text and "ernie55 = sglang_ernie55.plugin:register" in text


def test_installed_wheel_imports_both_kernels_packages(wheel, tmp_path):
    target = wheel_util.install(wheel, tmp_path)
    code = (
        "import kernels, sglang_ernie55.kernels as ours; "
        f"assert ours.__file__.startswith({str(target)!r}), ours.__file__; "
        f"assert not kernels.__file__.startswith({str(target)!r}), kernels.__file__; "
        "print('OK', kernels.__name__, ours.__name__)"
    )
    out = wheel_util.run_python(target, code)
    assert out.returncode == 0 and "OK kernels sglang_ernie55.kernels" in out.stdout, out.stderr[-3000:]
