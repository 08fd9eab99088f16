"""`sglang-ernie55`: one console script, one subcommand per tool.

Each subcommand lives in its own module of this package with three names:
`HELP` (one line), `configure(parser)` (adds its arguments; its docstring becomes the long help) and
`run(args) -> int` (the exit status). Modules import heavy packages (torch, sglang) inside `run`, so
`--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .._version import SGLANG_PIN, __version__

# subcommand -> module (order = order in --help)
SUBCOMMANDS: dict[str, str] = {
    "demo": "sglang_ernie55.cli.demo",
    "make-tiny": "sglang_ernie55.cli.make_tiny",
    "cmd": "sglang_ernie55.cli.cmd",
    "plan": "sglang_ernie55.cli.plan",
    "preflight": "sglang_ernie55.cli.preflight",
    "translate": "sglang_ernie55.cli.translate",
}

DESCRIPTION = """\
Tools around serving Baidu ERNIE-5.5-Flash with SGLang.

The server itself is SGLang's: `sglang serve --model-path baidu/ERNIE-5.5-Flash-Base ...`; this
package's plugin makes it pick the `ernie55` attention backend, 256-token pages, SWA ratio 0.1 and
FP8 KV by itself, and refuses flag combinations that would silently do the wrong thing.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-ernie55", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"sglang-ernie55 {__version__} (for sglang=={SGLANG_PIN})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:  # subcommand not built in this version
                continue
            raise
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=mod.configure.__doc__ or mod.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.configure(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
