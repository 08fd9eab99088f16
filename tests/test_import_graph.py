"""No import cycle among the modules of `sglang_ernie55`.

Every module is parsed with `ast`; an edge is any import of a package module, at module level or inside a
function (a function-level import still runs the module, and hoisting it would expose the cycle). Imports
under `if TYPE_CHECKING:` never run and are left out; the patch ledger's rows count as imports of
`sglang_ernie55.patches` (it imports them by name). A failure prints each cycle with every edge's line.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import sglang_ernie55

PACKAGE = "sglang_ernie55"
ROOT = Path(sglang_ernie55.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """(node, inside a function) for each import statement, skipping `if TYPE_CHECKING:` bodies."""
    stack = [(tree, False)]
    while stack:
        node, in_fn = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_fn
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse
        else:
            children = list(ast.iter_child_nodes(node))
        fn = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, fn) for child in children)


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        return [t for a in node.names if a.name.startswith(PACKAGE) and (t := known(a.name))]
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not base.startswith(PACKAGE):
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in modules else known(base))
    return [t for t in out if t]


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: where ("file:line", "function-level" when inside a function)}."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_fn in _imports(tree):
            for target in _targets(module, path, node, modules):
                if target != module:
                    where = f"{path.relative_to(ROOT.parent)}:{node.lineno}" + (
                        " (function-level)" if in_fn else ""
                    )
                    graph[module].setdefault(target, where)
    from sglang_ernie55 import patches

    ledger = f"{PACKAGE}.patches"
    for row in patches.LEDGER:
        name = row.ours_module()
        if not name or not name.startswith(PACKAGE) or name == ledger:
            continue
        # SGLang's ModelRegistry imports every module of the package it is given
        named = [m for m in modules if m.startswith(name + ".")] if row.kind is patches.Kind.MODELS else []
        for target in [name, *named]:
            while target not in modules:
                target = target.rpartition(".")[0]
            graph[ledger].setdefault(target, f"patches.LEDGER row `{row.target}` (imported by name)")
    return graph


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _shortest_cycle(graph: dict[str, dict[str, str]], comp: list[str]) -> list[str]:
    members = set(comp)
    best: list[str] = []
    for start in comp:
        prev = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for child in graph[node]:
                if child == start:
                    path = [node]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    cycle = [start, *reversed(path[:-1]), start]
                    if not best or len(cycle) < len(best):
                        best = cycle
                    queue.clear()
                    break
                if child in members and child not in prev:
                    prev[child] = node
                    queue.append(child)
    return best


def describe_cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    out = []
    for comp in _components(graph):
        cycle = _shortest_cycle(graph, comp)
        edges = "\n".join(f"    {a} -> {b}   [{graph[a][b]}]" for a, b in zip(cycle, cycle[1:]))
        out.append(f"cycle among {len(comp)} modules ({', '.join(comp)}); shortest:\n{edges}")
    return out


def test_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "sglang_ernie55.configuration" in graph["sglang_ernie55.arch"]  # module level
    assert "sglang_ernie55.compat" in graph["sglang_ernie55.plugin"]
    # the ledger's rows count as imports of the ledger (they are imported by name when it is applied)
    assert "sglang_ernie55.mem_cache" in graph["sglang_ernie55.patches"]


def test_cycle_finder_reports_a_cycle_with_its_edges():
    graph = {
        "a": {"b": "a.py:1"},
        "b": {"c": "b.py:2 (function-level)"},
        "c": {"a": "c.py:3"},
        "d": {"a": "d.py:1"},
    }
    (message,) = describe_cycles(graph)
    assert "a -> b   [a.py:1]" in message and "b -> c   [b.py:2 (function-level)]" in message
    assert "c -> a   [c.py:3]" in message and message.startswith("cycle among 3 modules (a, b, c);")


def test_no_import_cycles():
    cycles = describe_cycles(import_graph())
    assert not cycles, "import cycles in sglang_ernie55:\n" + "\n".join(cycles)
