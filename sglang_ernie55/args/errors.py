"""The error every ERNIE-5.5 server-argument rule raises."""

from __future__ import annotations

from collections.abc import Iterable


class Ernie55ArgumentError(ValueError):
    """A server argument ERNIE-5.5-Flash cannot be served with.

    The message names the flag, the value given, the legal values and why, in that order, so that
    `sglang serve` fails at argument resolution (before any GPU work) with one readable line.
    A ValueError, so SGLang's launchers report it like their own argument errors.
    """

    def __init__(self, flag: str, value: object, legal: object, why: str, fix: str = ""):
        self.flag = flag
        self.value = value
        if isinstance(legal, str) or not isinstance(legal, Iterable):
            self.legal = str(legal)
        else:
            self.legal = ", ".join(str(v) for v in legal)
        self.why = why
        self.fix = fix
        msg = f"ERNIE-5.5: {flag} {value}: legal: {self.legal}. {why[:1].upper()}{why[1:]}"
        if fix:
            msg += f" {fix}"
        self._init_args = (flag, value, legal, why, fix)
        super().__init__(msg)

    def __reduce__(self):  # picklable across SGLang's processes despite the keyword-rich __init__
        return (type(self), self._init_args)
