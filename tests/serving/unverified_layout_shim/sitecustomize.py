"""Test-only (tests/serving/test_server_ep_gpu.py puts this folder on a GPU server's PYTHONPATH).

sglang-ernie55 refuses, when the model is built, the MoE all-to-all backends it has not run
(`models.ernie55.check_parallel_layout`). This lets `--moe-a2a-backend deepep` through that one check, so that a
machine with enough GPUs can run the DeepEP test that decides whether the refusal can be lifted; attention DP /
CP stay refused. Nothing else changes."""

from ernie55_shim_lib import patch_after_import


def _patch(module):
    orig = module.check_parallel_layout

    def check_parallel_layout(par, a2a_backend="none", *args, **kwargs):
        return orig(par, "none" if a2a_backend == "deepep" else a2a_backend, *args, **kwargs)

    module.check_parallel_layout = check_parallel_layout


patch_after_import({"sglang_ernie55.models.ernie55": _patch})
