"""Server-argument defaults and validation for the ERNIE-5.5 architectures.

Everything goes through SGLang 0.5.23's own resolution machinery, so it holds for `sglang serve`,
`python -m sglang.launch_server` and `sglang.Engine` alike, and only for this model's architectures:

- `overrides.py`  : `register_model_override` for the ERNIE architectures (the model's defaults);
- `resolution.py` : `register_resolution_hook` wrappers that validate what the user gave;
- `rules.py`      : the rules themselves, as plain functions over values, and `ERNIE55_FLAG_RULES`;
- `requests.py`   : request-time rules (served `model` name, `n > 1` under PD), HookRegistry hooks;
- `api.py`        : `resolve_server_args(argv)`, SGLang's resolution with this plugin registered.

The overrides, wrappers and hooks are registered with SGLang by the patch ledger (patches.py, whose rows
also add `ernie55` to SGLang's backend choice lists). docs/server-args.md is the user-facing table.
"""

from __future__ import annotations

from .api import resolve_server_args, write_config_checkpoint
from .errors import Ernie55ArgumentError
from .rules import ERNIE55_FLAG_RULES, flag_rules_markdown

__all__ = [
    "ERNIE55_FLAG_RULES",
    "Ernie55ArgumentError",
    "flag_rules_markdown",
    "resolve_server_args",
    "write_config_checkpoint",
]
