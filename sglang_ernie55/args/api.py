"""`resolve_server_args(argv)`: SGLang's own argument resolution, with this plugin registered.

It runs what `sglang serve` runs before it touches a GPU (plugins, `prepare_server_args`, `resolve_once`),
so the launch-command generator can prove every hardware cell's command legal. Read the decided values
with `server_args.resolved_dict()`; the raw fields keep what the user typed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# Leading words of a shell command that are not flags: `sglang serve ...`, `python -m sglang.launch_server ...`.
_COMMAND_PREFIXES = (
    ("sglang", "serve"),
    ("python", "-m", "sglang.launch_server"),
    ("python3", "-m", "sglang.launch_server"),
)


def _strip_command(argv: Sequence[str]) -> list[str]:
    args = list(argv)
    for prefix in _COMMAND_PREFIXES:
        if tuple(args[: len(prefix)]) == prefix:
            return args[len(prefix) :]
    return args


def ensure_plugin_loaded() -> None:
    """SGLang's plugin loader (all general plugins, then the hook registry), plus ours even when
    `SGLANG_PLUGINS` leaves it out."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from .. import plugin

    load_plugins()
    plugin.register()
    HookRegistry.apply_hooks()  # applies only targets not yet patched


def resolve_server_args(argv: Sequence[str], *, device: str | None = None) -> ServerArgs:
    """Parse and resolve `argv` exactly as `sglang serve` does; return the resolved ServerArgs.

    - `argv`: the flags (`["--model-path", p, "--tp", "8", ...]`); a leading `sglang serve` or
      `python -m sglang.launch_server` is dropped.
    - `device`: appended as `--device <device>` when `argv` has no `--device` (on a machine without
      an accelerator SGLang stops at "No accelerator" unless the device is given; `"cpu"` there).
      The ERNIE-5.5 rules depend on the architecture only, not on the device.

    Raises `Ernie55ArgumentError` (a ValueError) for an illegal ERNIE-5.5 flag, SGLang's own
    ValueError/AssertionError for what SGLang rejects, and SystemExit for what argparse rejects.
    The caller's logging configuration is left as it was (`prepare_server_args` calls
    `logging.basicConfig(force=True)`; the root handlers and level are restored after it).
    """
    from sglang.srt.server_args import prepare_server_args

    ensure_plugin_loaded()
    args = _strip_command(argv)
    if device is not None and not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", device]
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        server_args = prepare_server_args(args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    server_args.resolve_once()
    return server_args


def write_config_checkpoint(path: str | os.PathLike, config: Any = None) -> str:
    """Write a config-only checkpoint (`config.json` alone: all SGLang's argument resolution reads) and
    return its path, for `resolve_server_args(["--model-path", it, ...])` without downloading weights.

    `config`: an `Ernie55Config` or a config.json dict; default the full-size ERNIE-5.5-Flash geometry
    (`Ernie55Config()`: 512 experts, o_groups 8, 1M positions), which is what the rules read.
    """
    from ..configuration import Ernie55Config

    if config is None:
        config = Ernie55Config()
    if isinstance(config, Ernie55Config):
        config = config.to_config_json()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return str(out)
