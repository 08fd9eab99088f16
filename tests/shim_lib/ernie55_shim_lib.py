"""Test-only: what the test servers' shims (the `sitecustomize.py` of tests/*/*_shim/, docs/hooks.md "Test-only
shims") share. A test starts a shimmed server with `shim_pythonpath(shim)` as its PYTHONPATH: the shim's folder,
then this one (so the shim imports `ernie55_shim_lib`; the name is the project's own, so it shadows nothing).

- `shim_pythonpath(shim)`: that PYTHONPATH, ahead of the test process's own;
- `patch_after_import(patches)`: run `patches[name](module)` right after SGLang (or this package) executes the
  module `name`, before anything else sees it, whether it is imported now or later;
- `load_shims(*paths)`: run other shims' `sitecustomize.py` files unchanged (Python imports one `sitecustomize`
  per process, so a server that needs two shims gets a folder whose own file loads both).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

SHIM_LIB = Path(__file__).resolve().parent


def shim_pythonpath(shim: Path) -> str:
    """PYTHONPATH for a server with `shim`'s `sitecustomize.py`: the shim, this folder, then the current one."""
    return os.pathsep.join(p for p in (str(shim), str(SHIM_LIB), os.environ.get("PYTHONPATH")) if p)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Callable]):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        # the spec the other finders give, with our patch run after the module's own code
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patches[name](module)

        spec.loader.exec_module = exec_module
        return spec


def patch_after_import(patches: dict[str, Callable]) -> None:
    """Patch each module of `patches` (dotted name -> fn(module)) once it is executed; one already imported (by an
    earlier `sitecustomize` or `.pth` file) is patched now."""
    later = {}
    for name, fn in patches.items():
        if name in sys.modules:
            fn(sys.modules[name])
        else:
            later[name] = fn
    if later:
        sys.meta_path.insert(0, _PatchAfterImport(later))


def load_shims(*paths: Path) -> None:
    """Run each shim file (a `sitecustomize.py`) as its own module, once per process."""
    for path in paths:
        name = f"_ernie55_shim_{path.parent.name}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
