"""Triton kernels of ERNIE-5.5-Flash (installed as ``sglang_ernie55.kernels``).

Each kernel: a thin launcher in ``kernels/<name>.py`` (formula, argument shapes/dtypes, asserts) over a
``@triton.jit`` body in ``kernels/_triton/<name>.py``. Cache byte layouts: ``kernels/layout.py``; their
byte-exact torch twin: ``kernels/torch_twin.py``.
The pure-PyTorch oracle: ``sglang_ernie55.reference`` (``functional``, ``rope``, ``mhc``, ``kernels_ref``).
"""
