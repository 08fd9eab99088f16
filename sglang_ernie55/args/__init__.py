"""Server-argument defaults and validation for the ERNIE-5.5 architectures.

Everything goes through SGLang 0.5.23's own resolution machinery, so it holds for `sglang serve`,
`python -m sglang.launch_server` and `sglang.Engine` alike, and only for this model's architectures:

- `overrides.py`  : `register_model_override` for the ERNIE architectures (the model's defaults);
- `resolution.py` : `register_resolution_hook` wrappers that validate what the user gave;
- `rules.py`      : the rules themselves, as plain functions over values, and `ERNIE55_FLAG_RULES`;
- `requests.py`   : request-time rules (served `model` name, `n > 1` under PD), HookRegistry hooks;
- `api.py`        : `resolve_server_args(argv)`, SGLang's resolution with this plugin registered.

docs/server-args.md is the user-facing table; docs/hooks.md the patch ledger.
"""

from __future__ import annotations

from .api import resolve_server_args, write_config_checkpoint
from .errors import Ernie55ArgumentError
from .rules import ERNIE55_FLAG_RULES, flag_rules_markdown

__all__ = [
    "ERNIE55_FLAG_RULES",
    "Ernie55ArgumentError",
    "flag_rules_markdown",
    "register",
    "resolve_server_args",
    "write_config_checkpoint",
]

_registered = False


def register() -> None:
    """Register model overrides, resolution hooks and request hooks with SGLang (idempotent)."""
    global _registered
    if _registered:
        return
    # Make `ernie55` a legal choice (the choice lists are shared with argparse by reference). The
    # backend factory itself is registered by sglang_ernie55.attention, not here.
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND,
        add_attention_backend_choices,
        add_deterministic_attention_backend_choices,
        add_draft_attention_backend_choices,
        add_radix_supported_deterministic_attention_backend_choices,
    )

    from . import overrides, requests, resolution
    from .rules import ATTENTION_BACKEND

    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])
    if ATTENTION_BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([ATTENTION_BACKEND])
    # --enable-deterministic-inference: the backend's kernels are batch invariant (fixed key splits, rows
    # independent of each other), also across radix-cache prefix hits (a hit recomputes no cached row and a
    # row's keys are the same stored values); see docs/serving-design.md "Deterministic inference"
    if ATTENTION_BACKEND not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices([ATTENTION_BACKEND])
    if ATTENTION_BACKEND not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        add_radix_supported_deterministic_attention_backend_choices([ATTENTION_BACKEND])
    overrides.register()
    resolution.register()
    requests.register()
    _registered = True
