"""Test-only (tests/serving/test_server_ep_gpu.py puts this folder on a GPU server's PYTHONPATH).

sglang-ernie55 refuses, when the model is built, the MoE all-to-all backends it has not run
(`models.ernie55.check_parallel_layout`). This lets `--moe-a2a-backend deepep` through that one check, so that a
machine with enough GPUs can run the DeepEP test that decides whether the refusal can be lifted; attention DP /
CP stay refused. Nothing else changes."""

import importlib.abc
import importlib.util
import sys

_MODULE = "sglang_ernie55.models.ernie55"


def _patch(module):
    orig = module.check_parallel_layout

    def check_parallel_layout(par, a2a_backend="none"):
        return orig(par, "none" if a2a_backend == "deepep" else a2a_backend)

    module.check_parallel_layout = check_parallel_layout


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
