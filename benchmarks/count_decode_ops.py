"""Count what one decode step of the tiny SGLang model dispatches outside the attention backend (CPU).

Runs the tiny model (`configuration.tiny_config`, 4 layers: dense+HCA, MLA-DSA, HCA, HCA) in-process on
the CPU harness (tests/serving/twin_harness.py: the `ernie55` backend's torch twin, bf16 KV pool), one
prefill of 140 tokens, then counts one batch-1 (or batch-B) decode step under a TorchDispatchMode:

- aten ops by kind: `launch` (an op that would launch a device kernel: everything not in the other kinds),
  `view` (aliasing ops: no kernel), `alloc` (empty / empty_strided: the caching allocator, no kernel),
  `sync` (`_local_scalar_dense`: `.item()`, a host sync, which a CUDA-graph decode must not have);
- Triton launches (each `kernel[grid](...)` call; under TRITON_INTERPRET=1 the interpreter's own torch
  calls are not counted);
- `copy_bytes`: bytes written by dtype conversions, clones and concatenations (per-step weight casts show
  up here);
- all of it split by region: `model` (the model forward: embedding, every layer's projections, mHC, norms,
  RoPE, MoE routing, hc_head, final norm), `attention_backend` (`forward_decode`, inside `model` but counted
  apart), `experts` (see below), `harness` (batch building, backend metadata, the harness's lm_head).

The layer compute is selected with SGLANG_ERNIE55_LAYER_IMPL (`torch` or `triton`; the Triton kernels run
in Triton's CPU interpreter here). The experts run on the harness's torch stand-in for FusedMoE (a
per-expert loop whose op count depends on the routing): they are excluded too (`experts`).

    TRITON_INTERPRET=1 SGLANG_ERNIE55_LAYER_IMPL=triton python benchmarks/count_decode_ops.py [--dtype bf16] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a script of the checkout: it drives the tests' CPU harness

ALLOC = {"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default"}


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.region = "harness"
        self.counts: dict = collections.defaultdict(collections.Counter)
        self.ops: dict = collections.defaultdict(collections.Counter)
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        if not self.paused:
            if name == "_local_scalar_dense.default":
                kind = "sync"
            elif func.is_view or name in ("detach.default", "alias.default", "lift_fresh.default"):
                kind = "view"
            elif name in ALLOC:
                kind = "alloc"
            else:
                kind = "launch"
            self.counts[self.region][kind] += 1
            if kind == "launch":
                self.ops[self.region][name] += 1
        out = func(*args, **(kwargs or {}))
        if not self.paused and name in ("_to_copy.default", "clone.default", "cat.default"):
            self.counts[self.region]["copy_bytes"] += out.numel() * out.element_size()
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ops", action="store_true", help="list the launching ops of the layers")
    a = ap.parse_args()
    import triton.runtime.interpreter as interp

    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.layers.moe import Ernie55LatentMoE
    from sglang_ernie55.reference.model import build_reference
    from tests.serving import twin_harness as th

    cfg = tiny_config()
    ref = build_reference(cfg, seed=0)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = th.build_model(cfg, dtype=dtype)
    model.load_weights(ref.state_dict().items())
    th.torch_experts(model)
    s = th.Session(model, cfg, torch.bfloat16, num_pages=8, max_ctx=1024, slots=a.batch)
    g = torch.Generator().manual_seed(0)
    for r in range(a.batch):
        s.extend([r], [torch.randint(3, cfg.vocab_size, (140 + r,), generator=g)])
    s.decode(list(range(a.batch)), [5] * a.batch)  # warm-up: lazy one-time preparation happens here

    mode = Counter()

    def wrap(obj, attr, region):
        orig = getattr(obj, attr)

        def inner(*args, **kw):
            prev, mode.region = mode.region, region
            try:
                return orig(*args, **kw)
            finally:
                mode.region = prev

        setattr(obj, attr, inner)

    wrap(model.model, "forward", "model")
    wrap(s.backend, "forward_decode", "attention_backend")
    for m in model.modules():
        if isinstance(m, Ernie55LatentMoE):
            wrap(m.experts, "forward", "experts")
    run = interp.InterpretedFunction.run

    def counted_run(self, *args, **kw):
        mode.counts[mode.region]["triton"] += 1
        mode.ops[mode.region][f"triton:{self.fn.__name__}"] += 1
        mode.paused += 1
        try:
            return run(self, *args, **kw)
        finally:
            mode.paused -= 1

    interp.InterpretedFunction.run = counted_run
    logits_fn = s._run
    try:
        with mode:
            logits_fn(
                __import__("sglang.srt.model_executor.forward_batch_info", fromlist=["x"]).ForwardMode.DECODE,
                list(range(a.batch)),
                [[5]] * a.batch,
                False,
            )
    finally:
        interp.InterpretedFunction.run = run
    impl = os.environ.get("SGLANG_ERNIE55_LAYER_IMPL", "auto")
    out = {"layer_impl": impl, "dtype": a.dtype, "batch": a.batch, "num_layers": cfg.num_hidden_layers}
    for region, c in mode.counts.items():
        out[region] = dict(c)
    lay = mode.counts["model"]
    out["model"]["device_launches"] = lay["launch"] + lay["triton"]
    if a.ops:
        out["model_ops"] = dict(mode.ops["model"].most_common())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
