"""Named profiler ranges of a forward (`forward_range`), read by benchmarks/bench_step.py to attribute each
kernel to a component of the decode step. Off unless SGLANG_ERNIE55_PROFILE_RANGES=1 when this module is first
imported: then every range is one shared no-op context (a host call per range in eager forwards, nothing inside
a CUDA graph)."""

from __future__ import annotations

import contextlib

import torch

from .envs import profile_ranges

PREFIX = "ernie55."  # every range's name starts with it: `ernie55.<component>[.<part>]`
ENABLED = profile_ranges()
_OFF = contextlib.nullcontext()


def forward_range(name: str):
    """`torch.profiler.record_function("ernie55." + name)` while ranges are on, else a no-op context. Names are
    dotted paths whose first part is the component (`hca`, `mla_dsa`, `moe.route`, ...; the table of
    benchmarks/bench_step.py); a kernel belongs to the innermost range open when it is launched."""
    if not ENABLED:
        return _OFF
    return torch.profiler.record_function(PREFIX + name)
