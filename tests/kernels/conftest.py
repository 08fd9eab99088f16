"""Kernel tests run the Triton kernels themselves: on a CUDA GPU natively, on CPU CI through the
Triton interpreter (TRITON_INTERPRET=1, set here before any kernel module is imported; tiny shapes only).
Tests marked `gpu` are the full-size ones (skipped with a reason on CPU by tests/conftest.py).

The variable stays set for the whole CPU session (with tests/shim_lib/triton_interpreter.py's speed-up): Triton reads it both when a function is decorated
and when it is launched. Without a GPU no compiled Triton kernel could run anyway, so other tests see
no difference beyond interpreted (instead of failing) Triton launches."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # only now may Triton be imported: its own @jit helpers (tl.zeros, ...) take the interpreter only when the
    # variable is set at their import. Then the interpreter without its nested re-patching (test-only speed-up,
    # tests/shim_lib/triton_interpreter.py; the kernels compute the same)
    from tests.shim_lib.triton_interpreter import install

    install()
