"""Test-only (tests/echo/test_echo_server_cpu.py puts this folder on the CPU server's PYTHONPATH).

SGLang 0.5.23 builds and verifies EAGLE trees on a CPU device only through sgl-kernel's CPU ops
(`build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`, behind SGLANG_USE_CPU_ENGINE=1), which the
installed sglang-kernel wheel does not carry; without them `spec_tree.build_tree_kernel_efficient_func`
reaches an undefined CUDA symbol. SGLang also ships Triton versions of both (its XPU path): this routes
`sglang.kernels.ops.speculative.spec_tree` to them (run by Triton's interpreter, TRITON_INTERPRET=1), and
nothing else. Every other piece of the EAGLE round is SGLang's own code. The interpreter runs with
tests/shim_lib/triton_interpreter.py's speed-up (no nested re-patching of `triton.language`)."""

from ernie55_shim_lib import patch_after_import
from triton_interpreter import install

install()


def _route_to_triton(module):
    module._is_xpu = True  # the Triton tree build / greedy verify (read at call time)


patch_after_import({"sglang.kernels.ops.speculative.spec_tree": _route_to_triton})
