"""Version pin and the SGLang symbols this plugin attaches to, checked at plugin load.

SGLang internals move fast. `check()` fails with a message that names the installed and the pinned
version before anything is patched, so a mismatch never turns into a silent misbehaviour. The symbols
and their expected parameters come from the patch ledger (patches.py).
"""

from __future__ import annotations

import importlib
import inspect

from . import envs
from ._version import SGLANG_PIN
from .patches import required_symbols


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version this plugin was written against."""


# (module, attribute path, parameters the attribute must accept, in order; None = only existence), one per
# row of the patch ledger: every symbol we patch and every one we call without patching.
REQUIRED_SYMBOLS: list[tuple[str, str, tuple[str, ...] | None]] = required_symbols()


def installed_sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def check_version() -> None:
    have = installed_sglang_version()
    if have != SGLANG_PIN and not envs.skip_version_check():
        raise SGLangVersionError(
            f"sglang-ernie55 is pinned to sglang=={SGLANG_PIN} but sglang=={have} is installed. "
            f"Install the pinned version (pip install sglang=={SGLANG_PIN}) or an sglang-ernie55 built for "
            f"{have}; SGLANG_ERNIE55_SKIP_VERSION_CHECK=1 loads anyway (unsupported)."
        )


def _resolve(module: str, attr_path: str):
    obj = importlib.import_module(module)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def check_symbols(symbols=None) -> None:
    """Each hooked symbol exists and takes the expected parameters; else SGLangVersionError naming it."""
    have = installed_sglang_version()
    for module, attr_path, params in symbols if symbols is not None else REQUIRED_SYMBOLS:
        where = f"{module}.{attr_path}"
        try:
            obj = _resolve(module, attr_path)
        except (ImportError, AttributeError) as e:
            raise SGLangVersionError(
                f"sglang {have}: `{where}` is missing ({e}); sglang-ernie55 needs sglang=={SGLANG_PIN}"
            ) from e
        if params is None:
            continue
        try:
            names = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as e:
            raise SGLangVersionError(f"sglang {have}: cannot inspect `{where}`: {e}") from e
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if names[: len(params)] != list(params):
            raise SGLangVersionError(
                f"sglang {have}: `{where}` takes {names}, expected it to start with {list(params)} "
                f"(as in sglang=={SGLANG_PIN}); this sglang-ernie55 does not support that SGLang"
            )


def check() -> None:
    check_version()
    check_symbols()
