"""Kernel tests run the Triton kernels themselves: on a CUDA GPU natively, on CPU CI through the
Triton interpreter (TRITON_INTERPRET=1, set here before any kernel module is imported; tiny shapes only).
Tests marked `gpu` are the full-size ones (skipped with a reason on CPU by tests/conftest.py)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
