"""Test-only speed-up of Triton's CPU interpreter (TRITON_INTERPRET=1), for the CPU kernel tests.

Triton's interpreter re-patches `triton.language` on every call of a nested `@triton.jit` helper
(`InterpretedFunction.__call__` runs `_patch_lang` again, an `inspect.getmembers` scan of the language
modules), although the kernel launch (`GridExecutor.__call__`) has already patched those same modules for its
whole grid. In our kernels' inner loops that repeated scan is about a third of the interpreter's time. `install()`
skips the nested patch when the helper sees only language modules the running launch patched; any other call runs
Triton's own code. What the kernels compute is unchanged: the patched language functions are the same objects.

Checked against the installed Triton at install time: if the interpreter does not look as expected (another
version's layout), nothing is changed and `install()` returns the reason.
"""

from __future__ import annotations

import inspect
import threading

_state = threading.local()
_installed = False


def install() -> str | None:
    """Install the speed-up (idempotent). Returns None when installed, else why not."""
    global _installed
    if _installed:
        return None
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError as e:
        return f"triton does not import: {e}"
    grid_cls = getattr(interp, "GridExecutor", None)
    fn_cls = getattr(interp, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or not hasattr(interp, "_patch_lang"):
        return "triton.runtime.interpreter lacks GridExecutor / InterpretedFunction / _patch_lang"
    try:
        fn_src = inspect.getsource(fn_cls.__call__)
        grid_src = inspect.getsource(grid_cls.__call__)
    except (OSError, TypeError) as e:
        return f"cannot read the interpreter's source: {e}"
    if (
        "_patch_lang(self.fn)" not in fn_src
        or "self.rewrite()" not in fn_src
        or "_patch_lang" not in grid_src
    ):
        return (
            "InterpretedFunction.__call__ / GridExecutor.__call__ differ from the layout this speed-up knows"
        )

    lang_modules = (tl, tl.core)
    cache: dict[object, frozenset[int]] = {}

    def langs(fn) -> frozenset[int]:
        """The language modules `_patch_lang(fn)` would patch (those visible in fn's globals)."""
        got = cache.get(fn)
        if got is None:
            got = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules
            )
            cache[fn] = got
        return got

    grid_call = grid_cls.__call__
    fn_call = fn_cls.__call__

    def launch(self, *args, **kwargs):
        prev = getattr(_state, "patched", None)
        _state.patched = langs(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.patched = prev

    def nested(self, *args, **kwargs):
        patched = getattr(_state, "patched", None)
        mine = langs(self.fn)
        if patched is None or not mine or not mine <= patched:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    grid_cls.__call__ = launch
    fn_cls.__call__ = nested
    _installed = True
    return None
