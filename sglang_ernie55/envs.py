"""Every environment variable this package reads, in one place.

| variable | default | meaning |
| --- | --- | --- |
| `SGLANG_PLUGINS` | unset | SGLang's own whitelist of general plugins; `ernie55` must be in it when it is set |
| `SGLANG_ERNIE55_SKIP_VERSION_CHECK` | `0` | `1` lets the plugin load on an SGLang other than the pinned one (unsupported) |
| `SGLANG_ERNIE55_ALLOW_PARSERS` | `0` | `1` lets `--reasoning-parser` / `--tool-call-parser` through on the Base model |
| `SGLANG_ERNIE55_ECHO_DUMP_DIR` | unset | tests only: the ECHO draft dumps its inputs / logits there (tests/echo) |
| `SGLANG_ERNIE55_HCA_ATTN` | `torch` | `triton` runs HCA attention of the `ernie55` backend through the Triton sparse kernel |
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def skip_version_check() -> bool:
    return _flag("SGLANG_ERNIE55_SKIP_VERSION_CHECK")


def allow_parsers() -> bool:
    return _flag("SGLANG_ERNIE55_ALLOW_PARSERS")


def sglang_plugins_whitelist() -> set[str] | None:
    raw = os.environ.get("SGLANG_PLUGINS", "")
    names = {x.strip() for x in raw.split(",") if x.strip()}
    return names or None


def hca_attn_impl() -> str:
    """`torch` (the backend's torch twin, default) or `triton` (kernels/sparse_attn)."""
    v = os.environ.get("SGLANG_ERNIE55_HCA_ATTN", "torch").strip().lower()
    if v not in ("torch", "triton"):
        raise ValueError(f"SGLANG_ERNIE55_HCA_ATTN={v!r}: legal values are 'torch' and 'triton'")
    return v
