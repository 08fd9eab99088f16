"""sglang-ernie55: serve Baidu ERNIE-5.5-Flash with SGLang (plugin, kernels, reference, tools)."""

from ._version import SGLANG_PIN, __version__

__all__ = ["__version__", "SGLANG_PIN"]
