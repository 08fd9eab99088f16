"""The paths, modules and names the user-facing docs (README.md, docs/*.md) cite exist.

Extraction, over the whole text of each document (prose, code spans, fenced blocks, link targets):

- a repository path is a run of `[\\w./{},*-]` that starts with one of the top-level folders
  (`sglang_ernie55/`, `tests/`, `scripts/`, `benchmarks/`, `docs/`, `docker/`) or ends in `.py` / `.sh` /
  `.toml` / `.md` inside backticks or as a link target; `{a,b}` is brace-expanded and `*` globbed. A path
  that starts with a top-level folder resolves from the repository root, a link target from the
  document's folder (as Markdown does); any other path (`functional.py`, `attention/select.py`,
  `speculative/eagle_worker_v2.py`) must be the tail of a file or folder path of the repository or of
  SGLang's installed `sglang/srt` tree;
- a dotted module is `sglang_ernie55.x.y...` (or `sglang_ernie55.x:y.z`, the ledger's form): its longest
  prefix that `importlib.util.find_spec` finds is the module, and what follows must be defined in that
  module's source (read with `ast`, not imported): a top-level name, then a name inside that class;
- a `module.name` code span whose `module.py` is a file of the package, the tests or the benchmarks
  (`kernel_path.compress`, `layout.fp8_unfit`, `kutil.PagedRequests`) must name something that file
  defines (any function, class, assignment or `self.` attribute in it), in at least one file of that name.

URLs, anchors, `ALLOWED_PATHS` and `ALLOWED_SPANS` are skipped.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_ernie55"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("sglang_ernie55", "tests", "scripts", "benchmarks", "docs", "docker")
SUFFIXES = (".py", ".sh", ".toml", ".md")
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".gpu"}

# Written in the docs on purpose, yet not files of this repository (each with the reason).
ALLOWED_PATHS = {
    "dist/sglang_ernie55-0.1.0-py3-none-any.whl": "the wheel `python -m build` writes",
}
# `module.name` code spans that name something other than a Python definition (each with the reason).
ALLOWED_SPANS = {
    "indexer.weights_proj": "a checkpoint tensor's name",
    "echo.norm": "a checkpoint tensor's name",
    "model.to()": "torch's Module.to on a model object",
}

PATH_RX = re.compile(r"(?<![\w./-])(?:" + "|".join(TOP) + r")/[\w./{},*-]*")
CODE_RX = re.compile(r"`([^`\n]+)`")
LINK_RX = re.compile(r"\]\(([^)\s]+)\)")
FILE_RX = re.compile(r"^[\w./{},*-]+(?:" + "|".join(re.escape(s) for s in SUFFIXES) + r")$")
MODULE_RX = re.compile(r"(?<![\w./])sglang_ernie55(?:\.\w+)+(?::\w+(?:\.\w+)*)?")
SHORT_RX = re.compile(r"^([a-z_]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _expand(text: str) -> list[str]:
    """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`]."""
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    return [x for alt in m.group(1).split(",") for x in _expand(text[: m.start()] + alt + text[m.end() :])]


def _clean(token: str) -> str:
    """Drop a link's anchor and trailing punctuation."""
    return token.split("#", 1)[0].rstrip(".,;:")


def _tree_paths(root: Path) -> set[str]:
    out = set()
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        rel = Path(here).relative_to(root)
        out |= {str(rel / name) for name in dirs + files}
    return out


@functools.cache
def _known_tails() -> frozenset[str]:
    """Every file and folder path of the repository and of SGLang's `sglang/srt`, as '/'-joined text."""
    paths = _tree_paths(ROOT)
    spec = importlib.util.find_spec("sglang")
    if spec and spec.submodule_search_locations:
        paths |= _tree_paths(Path(spec.submodule_search_locations[0]) / "srt")
    return frozenset(paths)


def _is_tail(path: str) -> bool:
    path = path.rstrip("/")
    return any(p == path or p.endswith("/" + path) for p in _known_tails())


def _doc_paths(doc: Path) -> list[tuple[str, Path | None]]:
    """(path as written, folder it resolves from; None: a tail of a known path) for every path named."""
    text = doc.read_text()
    found: list[tuple[str, Path | None]] = [(m.group(0), ROOT) for m in PATH_RX.finditer(text)]
    for m in LINK_RX.finditer(text):
        target = m.group(1)
        if "://" not in target and not target.startswith(("#", "mailto:")):
            found.append((target, doc.parent))
    for m in CODE_RX.finditer(text):
        for word in m.group(1).split():
            word = _clean(word.strip("()[]'\""))
            if FILE_RX.match(word) and not word.startswith(TOP):
                found.append((word, None))
    return found


def _missing_paths(doc: Path) -> list[str]:
    bad = set()
    for raw, base in _doc_paths(doc):
        for path in _expand(_clean(raw)):
            if not path or path in ALLOWED_PATHS:
                continue
            if base is None:
                ok = _is_tail(path)
            elif "*" in path:
                ok = any(base.glob(path))
            else:
                ok = (base / path).exists()
            if not ok:
                bad.add(path)
    return sorted(bad)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _top_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _top_names(node.body) | _top_names(node.orelse)
    return names


def _all_names(path: Path) -> set[str]:
    """Every function, class, assigned name and stored attribute anywhere in the file."""
    names = _top_names(_tree(path).body)
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _resolve_dotted(dotted: str) -> str | None:
    """None when `dotted` is a module, or a module followed by names defined in it; else why not."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest:
        return None
    if not spec.origin or not spec.origin.endswith(".py"):
        return f"{name} has no source to look `{rest[0]}` up in"
    body = _tree(Path(spec.origin)).body
    for i, attr in enumerate(rest):
        if attr not in _top_names(body):
            return f"`{'.'.join(rest[: i + 1])}` is not defined in {name}"
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == attr]
        if not classes:
            return None  # a function or a value: names below it are not checked
        body = classes[0].body
    return None


@functools.cache
def _package_modules() -> dict[str, list[Path]]:
    by_stem: dict[str, list[Path]] = {}
    for p in (q for d in ("sglang_ernie55", "tests", "benchmarks") for q in (ROOT / d).rglob("*.py")):
        by_stem.setdefault(p.stem, []).append(p)
    return by_stem


def _short_names(doc: Path) -> list[str]:
    """The `module.name` code spans whose module is one of our files that defines no such name."""
    bad = []
    for m in CODE_RX.finditer(doc.read_text()):
        span = m.group(1).strip()
        sm = SHORT_RX.match(span)
        if not sm or span in ALLOWED_SPANS or FILE_RX.match(span) or span.endswith(".safetensors"):
            continue
        module, attr = sm.groups()
        files = _package_modules().get(module)
        if files and not any(attr in _all_names(f) for f in files):
            bad.append(f"{span}: no `{attr}` in {', '.join(sorted(_rel(f) for f in files))}")
    return bad


def test_the_docs_are_there():
    assert (ROOT / "README.md").exists() and len(DOCS) > 5


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_paths_exist(doc):
    missing = _missing_paths(doc)
    assert not missing, f"{_rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_dotted_modules_resolve(doc):
    names = sorted({m.group(0) for m in MODULE_RX.finditer(doc.read_text())})
    bad = [f"{n}: {why}" for n in names if (why := _resolve_dotted(n))]
    assert not bad, f"{_rel(doc)} names modules / attributes that do not resolve: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_module_dot_name_spans_resolve(doc):
    bad = _short_names(doc)
    assert not bad, f"{_rel(doc)} names functions / values its modules do not define: {bad}"


def test_allow_listed_paths_are_not_files():
    present = [p for p in ALLOWED_PATHS if (ROOT / p).exists()]
    assert not present, f"allow-listed as not a file of the repository, yet present: {present}"


def test_the_rule_itself():
    assert _expand("tests/kernels/test_{a,b}.py") == ["tests/kernels/test_a.py", "tests/kernels/test_b.py"]
    assert PATH_RX.findall("see `sglang_ernie55/arch.py`, and tests/kernels/.") == [
        "sglang_ernie55/arch.py",
        "tests/kernels/.",
    ]
    assert _is_tail("attention/select.py") and _is_tail("speculative/eagle_worker_v2.py")
    assert not _is_tail("attention/no_such_file.py")
    assert _resolve_dotted("sglang_ernie55.arch.is_ernie55") is None
    assert _resolve_dotted("sglang_ernie55.patches:register") is None
    assert _resolve_dotted("sglang_ernie55.arch.no_such_name") is not None
    assert _resolve_dotted("sglang_ernie55.no_such_module") is not None
