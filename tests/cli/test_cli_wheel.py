"""The built wheel carries every hardware cell as package data, and `cmd` reads them from an installed
wheel (importlib.resources), not from the source tree."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from sglang_ernie55.deploy.cells import cell_files
from tests import wheel_util

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(built_wheel) -> Path:
    return built_wheel


def test_wheel_contains_every_cell(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sglang_ernie55/cells/__init__.py" in names
    shipped = {
        n.rsplit("/", 1)[1].removesuffix(".toml")
        for n in names
        if n.startswith("sglang_ernie55/cells/") and n.endswith(".toml")
    }
    assert shipped == set(cell_files()) and len(shipped) == 48


def test_installed_wheel_reads_its_cells(wheel, tmp_path):
    target = wheel_util.install(wheel, tmp_path)
    code = (
        "import sglang_ernie55.deploy.cells as c; "
        f"assert c.__file__.startswith({str(target)!r}), c.__file__; "
        "cell = c.find_cell('h100', 'bf16', 'high-throughput'); print(len(c.load_cells()), cell.shell_command())"
    )
    out = wheel_util.run_python(target, code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("48 sglang serve --model-path baidu/ERNIE-5.5-Flash-Base-BF16 --tp-size 16")
