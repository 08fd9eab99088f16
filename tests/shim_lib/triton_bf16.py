"""Test-only: fp32 -> bf16 conversions in Triton's CPU interpreter (TRITON_INTERPRET=1) rounded to nearest even.

On the GPU a kernel's `x.to(tl.bfloat16)` compiles to `cvt.rn.bf16.f32`: round to nearest, ties to even (torch's
`.to(torch.bfloat16)` rounds the same way). Triton's interpreter converts by bit manipulation instead: without a
rounding mode it truncates, and its RTNE branch rounds ties up and drops the carry into the exponent. A check that
compares a kernel's bf16 store bit for bit with the same value rounded elsewhere (a torch cast, or the same kernel
storing fp32 first) then sees the interpreter's rounding, not the kernel's. `install()` makes the interpreter's
fp32 -> bf16 conversions torch's; every other conversion stays Triton's own. `uninstall()` restores Triton's.

Checked against the installed Triton at install time: if the interpreter's builder lacks the methods patched
here, nothing is changed and `install()` returns the reason.
"""

from __future__ import annotations

_saved: dict = {}


def install() -> str | None:
    """Install the rounding (idempotent). Returns None when installed, else why not."""
    if _saved:
        return None
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError as e:
        return f"triton does not import: {e}"
    builder = getattr(interp, "InterpreterBuilder", None)
    handle = getattr(interp, "TensorHandle", None)
    if builder is None or handle is None or not all(
        hasattr(builder, m) for m in ("cast_impl", "create_fp_to_fp")
    ):
        return "triton.runtime.interpreter lacks InterpreterBuilder.cast_impl / create_fp_to_fp / TensorHandle"
    rtne = getattr(getattr(interp, "_ir", None), "ROUNDING_MODE", None)
    rtne = getattr(rtne, "RTNE", None)

    def bf16_bits(data):
        """float32 numpy data -> the uint16 bits of its bf16 rounding (nearest, ties to even), same shape."""
        a = np.ascontiguousarray(data, dtype=np.float32)
        return torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def is_f32_to_bf16(src, dst_type) -> bool:
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self, src, dst_type):
        if is_f32_to_bf16(src, dst_type):
            return handle(bf16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def to_fp(self, src, dst_type, rounding_mode):
        if is_f32_to_bf16(src, dst_type) and rounding_mode in (None, rtne):
            return handle(bf16_bits(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    _saved.update(builder=builder, cast_impl=cast_impl, create_fp_to_fp=fp_to_fp)
    builder.cast_impl = cast
    builder.create_fp_to_fp = to_fp
    return None


def uninstall() -> None:
    """Triton's own conversions again (no-op when not installed)."""
    if _saved:
        b = _saved.pop("builder")
        b.cast_impl, b.create_fp_to_fp = _saved.pop("cast_impl"), _saved.pop("create_fp_to_fp")
