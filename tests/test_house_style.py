"""House style that review keeps asking for, checked so it stays true.

- the formatter owns the layout: no format-skip markers in the package, tests or benchmarks;
- the package's code says what is, never how it came to be (no stage numbers, helper names, dates);
- module docstrings of the package are short (at most 6 lines);
- tests import the installed package, never a patched `sys.path`;
- user-facing text points only at files a user has (no `../shared`, no private design documents);
- the hardware cells' header comments name files that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_ernie55"
MAX_MODULE_DOCSTRING_LINES = 6

# Built from pieces so this file does not match its own checks.
FMT_SKIP = "# fmt" + ": skip"
SYS_PATH_INSERT = "sys.path" + ".insert"
HISTORY = [
    r"\bstage [0-9]",
    r"\bhelper-[0-9]",
    r"\blater stage",
    r"\bonce it exists",
    r"\b20[0-9][0-9]-[01][0-9]-[0-3][0-9]\b",
]
PRIVATE_DOCS = ["../" + "shared", "SERVING" + ".md", "ARCHITECTURE" + ".md"]


def _py(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_format_skip_markers():
    bad = [
        f"{_rel(p)}:{i}"
        for p in _py("sglang_ernie55", "tests", "benchmarks")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if FMT_SKIP in line
    ]
    assert not bad, f"`{FMT_SKIP}` markers (let `ruff format` lay the code out): {bad}"


@pytest.mark.parametrize("pattern", HISTORY)
def test_no_history_in_package(pattern):
    rx = re.compile(pattern, re.IGNORECASE)
    bad = [
        f"{_rel(p)}:{i}: {line.strip()}"
        for p in _py("sglang_ernie55")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if rx.search(line)
    ]
    assert not bad, "say what the code is, not how it came to be:\n" + "\n".join(bad)


def test_module_docstrings_are_short():
    bad = []
    for p in _py("sglang_ernie55"):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc is not None and len(doc.strip("\n").splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            bad.append(f"{_rel(p)}: {len(doc.strip(chr(10)).splitlines())} lines")
    assert not bad, f"module docstrings longer than {MAX_MODULE_DOCSTRING_LINES} lines: {bad}"


def test_tests_do_not_patch_sys_path():
    bad = [_rel(p) for p in _py("tests") if SYS_PATH_INSERT in p.read_text()]
    assert not bad, f"tests import the installed package (`pip install -e .`), not a patched path: {bad}"


def test_no_pointers_to_private_documents():
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "scripts").glob("*.sh")),
    ]
    files += _py("sglang_ernie55")
    bad = [
        f"{_rel(p)}:{i}: {word}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for word in PRIVATE_DOCS
        if word in line
    ]
    assert not bad, f"users do not have these files; state the fact or cite docs/: {bad}"


def test_cell_headers_name_existing_files():
    cells = sorted((PACKAGE / "cells").glob("*.toml"))
    assert cells
    path_rx = re.compile(r"[\w./-]+/[\w.-]+\.(?:py|md|toml|sh)\b")
    bad = []
    for cell in cells:
        header = []
        for line in cell.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        named = path_rx.findall("\n".join(header))
        assert named, f"{_rel(cell)}: the header names no file"
        bad += [f"{_rel(cell)}: {name}" for name in named if not (ROOT / name).exists()]
    assert not bad, f"cell headers name missing files: {bad}"
