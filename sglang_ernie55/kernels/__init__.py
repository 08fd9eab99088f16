"""Triton kernels of ERNIE-5.5-Flash.

Each kernel is a launcher in ``kernels/<name>.py`` (formula, shapes, checks) over a ``@triton.jit`` body in
``kernels/_triton/<name>.py``. KV byte layouts: ``layout.py``; their byte-exact torch codec: ``torch_twin.py``;
the pure-PyTorch oracle: ``sglang_ernie55.reference``.
"""
