"""Server-argument defaults and validation for the ERNIE-5.5 architectures.

All of it runs inside SGLang's own resolution, so it holds for `sglang serve`, `launch_server` and
`sglang.Engine` alike: `overrides` (the model's defaults), `resolution` (checks around SGLang's resolution
steps), `rules` (the rules as plain functions), `requests` (request-time rules), `api` (`resolve_server_args`).
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
