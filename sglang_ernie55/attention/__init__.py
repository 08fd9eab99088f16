"""The `ernie55` attention backend (docs/serving-design.md). `register()` adds it to SGLang's
attention registry (`ATTENTION_BACKENDS`, via `register_attention_backend`); the CLI choice
(`add_attention_backend_choices`) is registered by `sglang_ernie55.args`."""

from __future__ import annotations

BACKEND_NAME = "ernie55"


def create_ernie55_backend(model_runner):
    from .backend import Ernie55AttnBackend

    return Ernie55AttnBackend(model_runner)


def register() -> None:
    """Register the backend factory (idempotent: the registry is a dict)."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(BACKEND_NAME)(create_ernie55_backend)
