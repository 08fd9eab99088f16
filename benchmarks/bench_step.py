"""Decode-step breakdown of ERNIE-5.5 served by SGLang: step time, time per component, and each component's
byte and FLOP floors.

    python benchmarks/bench_step.py [--batches 1,8,64,256] [--contexts 4096,32768] [--out DIR]
    python benchmarks/bench_step.py --cpu-smoke --out DIR      # tiny model on the CPU: the whole pipeline

How it measures (docs/benchmarks.md, "How the step breakdown is measured"):

- Model: the 4-layer full-width FP8 checkpoint (`make_checkpoint(preset="full-width", layers=4, dtype="fp8")`,
  as tests/serving/test_full_width_gpu.py serves it), loaded by SGLang's own `ModelRunner` in this process
  through `sglang.benchmark.one_batch.load_model`, the harness of SGLang's single-batch benchmark: the plugin's
  pool, the `ernie55` backend, FP8 linears and FusedMoE, the decode CUDA graphs captured for the measured batch
  sizes, the sampler, exactly as a server builds them (`--cuda-graph-bs-decode` = the batch sizes, the server's
  other defaults: fp8_e4m3 KV, page 256, SGLANG_ERNIE55_ATTN_IMPL / _LAYER_IMPL `auto`).
- Context without prefill: B requests of `ctx` random tokens get their KV slots from SGLang's scheduler code
  (`ScheduleBatch.prepare_for_extend`, SGLang's allocators and page tables) but the prefill forward is skipped;
  every pool row was filled with random rows in the pool's own byte layout beforehand, so each decode step reads
  a real-sized, well-formed context (the numbers do not depend on the values). `--swa-full-tokens-ratio 1`: the
  SWA pool holds every request's window rows at once (a server frees out-of-window rows during prefill).
- Decode steps are the scheduler's: `prepare_for_decode`, `ForwardBatch.init_new`, `ModelRunner.forward` (graph
  replay at the captured batch sizes) and `ModelRunner.sample` (greedy).
- Step time: CUDA events around one step (batch preparation, forward, sampling), device idle at its start,
  median of `--steps` steps; the synchronised wall time beside it.
- Breakdown: `torch.profiler` traces of a few graph-replay steps and of a few eager steps (the graph runner
  switched off for them). The model opens named ranges (`sglang_ernie55.profiling`, on here through
  SGLANG_ERNIE55_PROFILE_RANGES=1) around each component; the bench adds `sampling` and the backend's metadata
  build (`attn_meta`). An eager kernel belongs to the innermost range open when it was launched (the launch's
  correlation id ties the kernel to its CPU launch). Kernels replayed from a graph carry no ranges: the graph's
  kernel sequence is aligned by name with the eager step's (difflib), and each matched kernel takes its eager
  twin's component; unmatched ones count as `other`. `launch gaps` = the step's device span minus the time some
  kernel runs. On the CPU (no kernels) the work items are the top-level aten ops and the gaps are host time
  between them.
- Floors: bytes a component must move (weights it touches from the real parameter shapes, experts hit at batch
  B estimated as E * (1 - (1 - k/E)^B) per layer, the KV rows it reads in the pool's layout, the activations of
  the mHC streams and the logits) at the copy bandwidth measured in the same run (2 GiB device-to-device copy,
  read + write), and its GEMM / attention FLOPs at the measured bf16, fp8 (`torch._scaled_mm`) and fp32 GEMM
  rates. `x floor` = measured time / max(byte floor, FLOP floor).

Outputs: a table per point on stdout (with the kernels each component launches per step), `bench_step.json` and
`bench_step.md` in --out (rewritten after every point, so a run cut short still reports), and the gzipped Chrome
traces of the last measured point in `bench_step_traces.tar`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import gzip
import io
import json
import math
import os
import sys
import tarfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# a script of the checkout: it serves the checkout's package, wherever another copy is installed
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T0 = time.monotonic()
# sglang_ernie55.profiling.PREFIX, written out: the package is imported in main, after the flag is set
PREFIX = "ernie55."
STEP_RANGE = PREFIX + "bench.step"
SAMPLING = "sampling"
ATTN_META = "attn_meta"

# Table rows: (key, label, range names whose kernels it sums; a name matches itself and its dotted children).
COMPONENTS = (
    ("embed", "embedding + RoPE rows", ("embed",)),
    (ATTN_META, "attention metadata", (ATTN_META,)),
    ("hca", "HCA attention + compression", ("hca",)),
    ("mla_dsa", "MLA-DSA + indexer + top-k", ("mla_dsa",)),
    ("dense_ffn", "dense FFN", ("dense_ffn",)),
    ("moe.route", "MoE routing", ("moe.route",)),
    ("moe.latent", "latent down / up", ("moe.latent",)),
    ("moe.experts", "expert GEMMs", ("moe.experts",)),
    ("moe.shared", "shared expert", ("moe.shared",)),
    ("mhc", "mHC + sub-layer norms", ("mhc",)),
    ("lm_head", "LM head", ("lm_head",)),
    (SAMPLING, "sampling", (SAMPLING,)),
    ("other", "other (outside the ranges)", ()),
)
COMPONENT_KEYS = [c[0] for c in COMPONENTS]

FULL_GRID = dict(batches=(1, 8, 64, 256), contexts=(4096, 32768))
SMOKE_GRID = dict(batches=(1, 2), contexts=(200,))


# ----------------------------------------------------------------------------------------------- trace parsing
def component_of(range_name: str | None) -> str:
    """The table row of a kernel whose innermost open range is `range_name` (None: no range of ours)."""
    if range_name is None:
        return "other"
    name = range_name[len(PREFIX) :] if range_name.startswith(PREFIX) else range_name
    for key, _, names in COMPONENTS:
        if any(name == n or name.startswith(n + ".") for n in names):
            return key
    return "other"


@dataclasses.dataclass
class Work:
    """One unit of device work (a kernel, memcpy or memset; on the CPU a top-level aten op)."""

    name: str
    start: float  # us, its own timeline
    dur: float  # us
    launch: float  # us, host timeline (the CPU launch; on the CPU the op's own start)
    graph: bool = False  # replayed from a CUDA graph (its launch is the graph launch)
    range: str | None = None  # innermost range of ours open at the launch
    component: str = "other"


def _innermost(ranges: list[dict], t: float) -> str | None:
    """Name of the latest-starting range containing host time t (ranges sorted by start; properly nested)."""
    lo, hi = 0, len(ranges)
    while lo < hi:
        mid = (lo + hi) // 2
        if ranges[mid]["ts"] <= t:
            lo = mid + 1
        else:
            hi = mid
    for r in reversed(ranges[:lo]):
        if r["ts"] + r["dur"] >= t:
            return r["name"]
    return None


def work_items(trace: dict) -> tuple[list[dict], list[Work], bool]:
    """(step ranges sorted by start, work items with their innermost range, device trace?) of a Chrome trace
    written by torch.profiler. Device traces: kernels / memcpys / memsets tied to their CPU launch (runtime or
    driver API event) by the correlation id. An item whose launch is not in the trace: in a trace without graph
    launches, placed at the host op its `External id` names (the innermost profiled op open at its launch);
    otherwise at its own start and treated as graph-replayed (its component comes from the alignment). Host
    traces (no device events): the top-level `cpu_op` events of each thread."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ours = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(PREFIX)]
    steps = sorted((e for e in ours if e["name"] == STEP_RANGE), key=lambda e: e["ts"])
    ranges = sorted((e for e in ours if e["name"] != STEP_RANGE), key=lambda e: e["ts"])
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    items: list[Work] = []
    if device:
        launches = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = e
        graphs = any("GraphLaunch" in e["name"] for e in launches.values())
        host_op = {
            e["args"]["External id"]: float(e["ts"])
            for e in events
            if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in e.get("args", {})
        }
        for k in device:
            lau = launches.get(k.get("args", {}).get("correlation"))
            ts, dur = float(k["ts"]), float(k["dur"])
            ext = k.get("args", {}).get("External id")
            if lau is None and not graphs and ext in host_op:
                items.append(Work(k["name"], ts, dur, host_op[ext]))
            elif lau is None:
                items.append(Work(k["name"], ts, dur, ts, graph=True))
            else:
                items.append(Work(k["name"], ts, dur, float(lau["ts"]), "GraphLaunch" in lau["name"]))
    else:
        by_thread: dict = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        for ops in by_thread.values():
            ops.sort(key=lambda e: (e["ts"], -e["dur"]))
            end = -math.inf
            for e in ops:
                if e["ts"] >= end:  # not inside the previous top-level op
                    items.append(Work(e["name"], float(e["ts"]), float(e["dur"]), float(e["ts"])))
                    end = e["ts"] + e["dur"]
    for w in items:
        if not w.graph:
            w.range = _innermost(ranges, w.launch)
            w.component = component_of(w.range)
    items.sort(key=lambda w: w.start)
    return steps, items, bool(device)


def split_steps(steps: list[dict], items: list[Work]) -> list[list[Work]]:
    """The items launched inside each step range."""
    out: list[list[Work]] = [[] for _ in steps]
    for w in items:
        for i, s in enumerate(steps):
            if s["ts"] <= w.launch <= s["ts"] + s["dur"]:
                out[i].append(w)
                break
    return out


def align_graph(reference: list[Work], replay: list[Work]) -> float:
    """Give each graph-replayed item of `replay` the component of its eager twin in `reference` (one eager step's
    items in launch order), matching the two name sequences (difflib, no junk heuristic); unmatched graph items
    are `other`. Returns the fraction of graph items matched."""
    ref = [w for w in reference if w.component not in ("other", SAMPLING)]
    graph = [w for w in replay if w.graph]
    if not graph:
        return 0.0
    sm = difflib.SequenceMatcher(None, [w.name for w in ref], [w.name for w in graph], autojunk=False)
    matched = 0
    for w in graph:
        w.component, w.range = "other", None
    for a, b, n in sm.get_matching_blocks():
        for i in range(n):
            graph[b + i].component, graph[b + i].range = ref[a + i].component, ref[a + i].range
        matched += n
    return matched / len(graph)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


IDLE_MIN_US = 20.0  # a gap shorter than this is a launch's own latency, not a stall


def idle_gaps(items: list[Work], min_us: float = IDLE_MIN_US) -> list[tuple[float, str, str, bool]]:
    """The device's idle stretches inside one step's span (items sorted by start): (us, the innermost range of
    the item that ended the stretch, its name, whether the host launched it only after the device had gone
    idle: the host was late, from Python, a sync or the scheduler, rather than the item waiting on the
    device). Stretches of at least `min_us`; with the shorter ones they add up to span - busy."""
    out, end = [], None
    for w in items:
        if end is not None and w.start - end >= min_us:
            rng = (w.range or "(none)").removeprefix(PREFIX)
            out.append((w.start - end, rng, w.name, w.launch > end))
        end = w.start + w.dur if end is None else max(end, w.start + w.dur)
    return out


def summarize(step_items: list[list[Work]], steps: list[dict], device: bool) -> dict:
    """Per-step means (ms): span, busy, each component's work time, gaps, and the detail per innermost range and
    per kernel name. Span: first start to last end of the step's items (device), the step range (host)."""
    n = len(step_items)
    comp = dict.fromkeys(COMPONENT_KEYS, 0.0)
    launches = dict.fromkeys(COMPONENT_KEYS, 0)  # kernels (device) or ops (host) per component
    detail: dict[str, float] = {}
    kernels: dict[str, dict[str, float]] = {}
    span = busy = 0.0
    count = 0
    idle: dict[str, list[float]] = {}  # range -> [us host late, us launched before, stretches]
    largest: list[tuple[float, str, str, bool]] = []
    for items, rng in zip(step_items, steps):
        if device:
            if not items:
                continue
            s = min(w.start for w in items)
            span += max(w.start + w.dur for w in items) - s
            gaps = idle_gaps(sorted(items, key=lambda w: w.start))
            for us, where, _, late in gaps:
                row = idle.setdefault(where, [0.0, 0.0, 0])
                row[0 if late else 1] += us
                row[2] += 1
            largest = sorted(largest + gaps, key=lambda g: -g[0])[:8]
        else:
            span += rng["dur"]
        busy += _union([(w.start, w.start + w.dur) for w in items])
        for w in items:
            comp[w.component] += w.dur
            launches[w.component] += 1
            key = (w.range or "(none)").removeprefix(PREFIX)
            detail[key] = detail.get(key, 0.0) + w.dur
            kn = kernels.setdefault(w.component, {})
            kn[w.name] = kn.get(w.name, 0.0) + w.dur
        count += len(items)
    if n == 0:
        return {}
    ms = lambda us: us / n / 1e3  # noqa: E731
    top = {
        c: [[k, round(ms(v), 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:6]]
        for c, d in kernels.items()
    }
    return dict(
        steps=n,
        items_per_step=count / n,
        span_ms=ms(span),
        busy_ms=ms(busy),
        components={k: ms(v) for k, v in comp.items()},
        items_per_component={k: v / n for k, v in launches.items()},
        gaps_ms=ms(max(0.0, span - busy)),
        detail={k: ms(v) for k, v in sorted(detail.items(), key=lambda kv: -kv[1])},
        top_kernels=top,
        idle_by_range={
            k: dict(host_late_ms=ms(v[0]), launched_before_ms=ms(v[1]), stretches=v[2] / n)
            for k, v in sorted(idle.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        },
        idle_largest=[dict(ms=g[0] / 1e3, range=g[1], next=g[2], host_late=g[3]) for g in largest],
    )


def breakdown(trace: dict, reference: list[Work] | None = None) -> tuple[dict, list[Work]]:
    """Summary of a trace (see `summarize`); with `reference` (an eager step's items), graph-replayed items get
    their components by `align_graph`. Returns the summary and the last step's items (a reference for graphs)."""
    steps, items, device = work_items(trace)
    per_step = split_steps(steps, items)
    fractions = []
    if reference is not None:
        fractions = [align_graph(reference, s) for s in per_step if any(w.graph for w in s)]
    out = summarize(per_step, steps, device)
    if out:
        out["graph_items_per_step"] = sum(sum(w.graph for w in s) for s in per_step) / len(per_step)
        out["graph_match_fraction"] = min(fractions) if fractions else None
    return out, (per_step[-1] if per_step else [])


# ---------------------------------------------------------------------------------------------------- floors
def experts_hit(E: int, k: int, tokens: int) -> float:
    """Expected distinct experts of E that `tokens` tokens choosing k each (uniformly) touch: E (1 - (1 - k/E)^B)."""
    return E * (1.0 - (1.0 - k / E) ** tokens)


def _dtype_class(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8):
        return "fp8"
    return "fp32" if dtype == torch.float32 else "bf16"


class Floor:
    """Bytes and FLOPs (per GEMM dtype class) one component needs in one step."""

    def __init__(self):
        self.bytes = 0.0
        self.flops = {"fp8": 0.0, "bf16": 0.0, "fp32": 0.0}

    def weights(self, module, tokens: int, fraction: float = 1.0, per_token_frac: float = 1.0) -> None:
        """Every parameter of `module` read once (times `fraction`); its weight matrices (2-D or more, scales
        excluded) multiply `tokens` tokens (times `per_token_frac` of the matrix each: the experts a token uses)."""
        for name, p in module.named_parameters():
            self.bytes += p.numel() * p.element_size() * fraction
            if p.dim() >= 2 and "scale" not in name.rsplit(".", 1)[-1]:
                self.flops[_dtype_class(p.dtype)] += 2.0 * tokens * p.numel() * per_token_frac

    def to_dict(self, bw: float, rates: dict) -> dict:
        byte_ms = self.bytes / bw * 1e3
        flop_ms = sum(f / rates[c] * 1e3 for c, f in self.flops.items() if f and rates.get(c))
        return dict(bytes=self.bytes, flops=dict(self.flops), byte_ms=byte_ms, flop_ms=flop_ms)


def _row_bytes(codec) -> int:
    """Bytes per token row of one pool buffer (packed layout or dense rows)."""
    geom = getattr(codec, "geom", None)
    if geom is not None:
        return geom.bytes_per_token
    return codec.data.shape[1] * codec.data.element_size()


def attention_flops(cfg, kind: str, L: int) -> float:
    """The attention FLOPs of one query token that sees L keys, in a layer of `kind`: HCA over its window and the
    compressed entries (scores and values over the head dim), MLA-DSA's index scores over every key and its
    attention over the top-k (latent + RoPE keys, latent values). The projections are the layer's weights'."""
    from sglang_ernie55.configuration import LAYER_HCA

    if kind == LAYER_HCA:
        return (
            2.0
            * cfg.num_attention_heads
            * (min(L, cfg.window_size) + L // cfg.compress_ratio)
            * 2
            * cfg.head_dim
        )
    qk = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    index = 2.0 * cfg.index_n_heads * cfg.index_head_dim * L
    return index + 2.0 * cfg.num_attention_heads * min(L, cfg.index_topk) * (qk + cfg.kv_lora_rank)


def floors(model, cfg, pool, B: int, ctx: int) -> dict[str, Floor]:
    """Per component: what one decode step of B requests at context `ctx` must read and compute (see the module
    docstring). The model's real parameters give the weights; the pool's buffers give the KV row sizes."""
    from sglang_ernie55.configuration import LAYER_HCA

    out = {k: Floor() for k in COMPONENT_KEYS}
    m = model.model
    n, H = cfg.hc_mult, cfg.hidden_size
    L = ctx + 1  # keys visible to the new token
    stream = B * n * H * 4  # fp32 streams
    act_size = m.embed_tokens.weight.element_size()  # the activations' dtype (the embedding's)
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        if layer.kind == LAYER_HCA:
            f = out["hca"]
            f.weights(attn, B)
            W = min(L, cfg.window_size)
            ncmp = L // cfg.compress_ratio
            f.bytes += B * (W * _row_bytes(pool.win[i]) + ncmp * _row_bytes(pool.cmp[i]))
            f.flops["bf16"] += B * attention_flops(cfg, layer.kind, L)
        else:
            f = out["mla_dsa"]
            f.weights(attn, B)
            sel = min(L, cfg.index_topk)
            f.bytes += B * (L * _row_bytes(pool.index_k[i]) + sel * _row_bytes(pool.latent[i]))
            f.bytes += 2 * B * L * 4  # indexer logits written, then read by the top-k
            f.flops["bf16"] += B * attention_flops(cfg, layer.kind, L)
        mlp = layer.mlp
        if hasattr(mlp, "routers"):
            r = out["moe.route"]
            r.weights(mlp.routers, B)
            r.bytes += mlp.e_score_correction_bias.numel() * 4
            out["moe.latent"].weights(mlp.latent_down, B)
            out["moe.latent"].weights(mlp.latent_up, B)
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            out["moe.experts"].weights(mlp.experts, B, experts_hit(E, k, B) / E, k / E)
            if mlp.shared_experts is not None:
                out["moe.shared"].weights(mlp.shared_experts, B)
        else:
            out["dense_ffn"].weights(mlp, B)
        for hc in (layer.attn_hc, layer.ffn_hc):
            out["mhc"].weights(hc, B)
            out["mhc"].bytes += 3 * stream  # pre reads R; post reads R and writes R'
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            # the site's tail applies the sub-layer norm: its weight, and the normed row it writes
            out["mhc"].weights(norm, B)
            out["mhc"].bytes += B * H * act_size
    out["mhc"].weights(m.hc_head, B)
    out["mhc"].bytes += stream
    out["mhc"].weights(m.norm, B)
    out["mhc"].bytes += B * H * act_size
    out["embed"].bytes += B * H * act_size + stream
    V = cfg.vocab_size
    out["lm_head"].weights(model.lm_head, B)
    out["lm_head"].bytes += B * V * 4
    out[SAMPLING].bytes += B * V * 4
    return out


# --------------------------------------------------------------------------------------------- calibration
def _time_ms(fn, device: str, reps: int = 10, warmup: int = 3) -> float:
    """Median time of fn() in ms (CUDA events on a GPU, the host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def calibrate(device: str) -> dict:
    """Copy bandwidth (bytes read + written per second) and GEMM rates (FLOP/s) of this device, measured now."""
    big = device == "cuda"
    n = (2 << 30) if big else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    bw = 2 * n / (_time_ms(lambda: dst.copy_(src), device) / 1e3)
    src = dst = None
    rates = {}
    N = 8192 if big else 512
    for cls, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.randn(N, N, device=device, dtype=dtype)
        y = torch.randn(N, N, device=device, dtype=dtype)
        rates[cls] = (
            2 * N**3 / (_time_ms(lambda x=x, y=y: x @ y, device, reps=5 if cls == "fp32" else 10) / 1e3)
        )
    rates["fp8"] = None
    if big:
        try:
            x = torch.randn(N, N, device=device).to(torch.float8_e4m3fn)
            y = torch.randn(N, N, device=device).to(torch.float8_e4m3fn).t().contiguous().t()  # column-major
            one = torch.ones((), device=device)
            f = lambda: torch._scaled_mm(x, y, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
            rates["fp8"] = 2 * N**3 / (_time_ms(f, device) / 1e3)
        except Exception as e:  # noqa: BLE001
            print(
                f"[fp8 GEMM rate not measured: {type(e).__name__}: {str(e)[:160]}; fp8 FLOPs use the bf16 rate]"
            )
    if rates["fp8"] is None:
        rates["fp8"] = rates["bf16"]
    if big:
        torch.cuda.empty_cache()
    return dict(copy_bytes_per_s=bw, gemm_flops_per_s=rates)


# ---------------------------------------------------------------------------------------------- the runner
def server_argv(a, ckpt: Path, device: str, max_tokens: int) -> list[str]:
    """The server flags this bench builds its ModelRunner with (as `sglang serve` would take them)."""
    argv = ["--model-path", str(ckpt), "--max-running-requests", str(max(a.batches))]
    argv += ["--context-length", str(a.context_length), "--max-total-tokens", str(max_tokens)]
    argv += ["--swa-full-tokens-ratio", "1.0", "--sampling-backend", a.sampling_backend]
    argv += ["--log-level", a.log_level]
    if device == "cpu":
        from sglang_ernie55.cli.demo import CPU_SERVER_ARGS

        cpu = {flags[0]: flags[1:] for flags, _why in CPU_SERVER_ARGS}
        for name in ("--device", "--dtype", "--kv-cache-dtype"):
            argv += [name, *cpu[name]]
        argv += ["--disable-cuda-graph"]
    else:
        argv += ["--mem-fraction-static", str(a.mem_fraction_static), "--disable-prefill-cuda-graph"]
        if a.kv_cache_dtype:
            argv += ["--kv-cache-dtype", a.kv_cache_dtype]
        if a.eager:
            argv += ["--disable-cuda-graph"]
        else:
            argv += ["--cuda-graph-bs-decode", *[str(b) for b in sorted(set(a.batches))]]
    return argv + list(a.server_arg)


def load_runner(argv: list[str]):
    """SGLang's ModelRunner for these server flags, built as `sglang.benchmark.one_batch` builds it."""
    from sglang.benchmark import one_batch as ob
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs
    from sglang.srt.utils import configure_logger

    load_plugins()  # the ernie55 plugin: config, model, pool, backend (SGLang's processes call it at start)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sa = ServerArgs.from_cli_args(parser.parse_args(argv))
    sa.resolve_once()
    _set_envs_and_config(sa)
    port_args = PortArgs.init_new(sa)
    publish(
        sa,
        role="scheduler",
        ranks=SpawnRanks(world_rank=spawn_world_rank(sa, tp_rank=0, pp_rank=0), gpu_id=0),
    )
    ob._init_process_global_configs()
    configure_logger(sa, prefix=" TP0")
    bench_runner, _tokenizer = ob.load_model(sa, port_args, 0, 0)
    return bench_runner.torch_runner, sa


def ernie_backend(runner):
    """Our attention backend inside the runner's (possibly wrapped) backend."""
    from sglang_ernie55.attention.backend import Ernie55AttnBackend

    todo, seen = [runner.attn_backend], set()
    while todo:
        be = todo.pop()
        if id(be) in seen or be is None:
            continue
        seen.add(id(be))
        if isinstance(be, Ernie55AttnBackend):
            return be
        for v in vars(be).values():
            if isinstance(v, (list, tuple)):
                todo.extend(x for x in v if hasattr(x, "init_forward_metadata"))
            elif hasattr(v, "init_forward_metadata"):
                todo.append(v)
    raise RuntimeError(
        f"no Ernie55AttnBackend inside the runner's backend {type(runner.attn_backend).__name__}"
    )


def store_rows(codec, loc: torch.Tensor, x: torch.Tensor, kernel: bool) -> None:
    """Rows x [N, width] fp32 at slots loc [N] of one pool buffer: with `kernel`, through the serving store
    kernel (`kernels.kv_store`, packed layouts), else through the buffer's own codec (its byte-exact twin)."""
    if kernel and getattr(codec, "geom", None) is not None:
        from sglang_ernie55.kernels.kv_store import kv_store

        kv_store(codec.pool, codec.geom, loc, x)
    else:
        codec.write(loc, x)


def fill_pool(pool, seed: int = 0) -> None:
    """Random rows in every buffer of the pool (each in its own byte layout) and random open-block state: every
    decode read is of well-formed data. On CUDA through the store kernel, 1M rows a call."""
    cuda = torch.device(pool.device).type == "cuda"
    g = torch.Generator(device=pool.device).manual_seed(seed)
    chunk = 1 << 20 if cuda else 1 << 15
    for store in (pool.win, pool.cmp, pool.latent, pool.index_k):
        for codec in store.values():
            for s in range(0, codec.rows, chunk):
                e = min(codec.rows, s + chunk)
                loc = torch.arange(s, e, device=pool.device)
                store_rows(codec, loc, torch.randn(e - s, codec.width, device=pool.device, generator=g), cuda)
    for st in pool.state.values():
        st.normal_(generator=g)


class TreeCache:
    """The scheduler's tree cache as SGLang's one-batch benchmark stands it in (no prefix sharing), plus the two
    calls SGLang's SWA allocator makes on it when a pool runs short (nothing to evict here)."""

    def __init__(self, runner, page_size: int):
        from sglang.benchmark.one_batch import TreeCacheNamespace

        self.ns = TreeCacheNamespace(
            page_size=page_size,
            device=runner.device,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        )
        self.ns.evict_for_alloc = lambda params: None
        self.ns.available_and_evictable_str = lambda: "no tree cache (bench_step)"


class Point:
    """B requests holding `ctx` tokens each (slots allocated, no prefill), decoded step by step."""

    def __init__(self, runner, B: int, ctx: int, vocab: int, bos: int, seed: int):
        from array import array

        import numpy as np
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.runner = runner
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(B):
            ids = rng.integers(3, vocab, ctx, dtype=np.int64)
            ids[0] = bos
            req = Req(
                rid=f"bench-{i}",
                origin_input_text="",
                origin_input_ids=array("q", ids.tobytes()),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1024, ignore_eos=True),
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(req.origin_input_ids)
            reqs.append(req)
        self.tree = TreeCache(runner, get_schedule().page_size)
        self.batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=self.tree.ns,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        self.batch.prepare_for_extend()  # the scheduler's slot allocation and page tables; the forward is skipped
        self.next_ids = torch.from_numpy(rng.integers(3, vocab, B, dtype=np.int64)).to(runner.device)
        self.graph_used = None

    @torch.no_grad()
    def step(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        from sglang_ernie55.profiling import forward_range

        b, runner = self.batch, self.runner
        b.input_ids = self.next_ids
        b.prepare_for_decode()
        fb = ForwardBatch.init_new(b, runner, return_hidden_states_before_norm=False)
        out = runner.forward(fb)
        with forward_range(SAMPLING):
            self.next_ids = runner.sample(out.logits_output, fb).to(torch.int64)
        self.graph_used = bool(getattr(out, "can_run_graph", False))


class Eager:
    """Within: the runner's decode graphs are off (ModelRunner falls back to its eager runner)."""

    def __init__(self, runner):
        self.runner, self.saved = runner, None

    def __enter__(self):
        self.saved = getattr(self.runner, "decode_cuda_graph_runner", None)
        self.runner.decode_cuda_graph_runner = None

    def __exit__(self, *exc):
        self.runner.decode_cuda_graph_runner = self.saved


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Clock:
    """Elapsed ms between `start` and `stop`: CUDA events on a GPU (device time), the host clock on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        self.t = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        """(ms on the clock, host ms); synchronises."""
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
        host = (time.perf_counter() - self.t) * 1e3
        return (self.a.elapsed_time(self.b) if self.cuda else host), host


def timed_steps(point: Point, n: int, device: str) -> dict:
    """Median step time over n steps, each started with the device idle (CUDA events around one step; the host
    time beside it), then n steps back to back without a synchronisation between them (`pipelined_ms`: the host
    prepares the next step while the device runs, as SGLang's overlap scheduler lets it)."""
    clock, steps, wall = Clock(device), [], []
    for _ in range(n):
        sync(device)
        clock.start()
        point.step()
        ms, host = clock.stop()
        steps.append(ms)
        wall.append(host)
    sync(device)
    clock.start()
    for _ in range(n):
        point.step()
    total, _ = clock.stop()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return dict(
        step_ms=med(steps), wall_ms=med(wall), pipelined_ms=total / n, steps=n, graph=point.graph_used
    )


def profiled(point: Point, n: int, device: str, path: Path) -> dict:
    """n steps under torch.profiler (each inside the step range); the Chrome trace is written to `path`."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        for _ in range(n):
            with record_function(STEP_RANGE):  # the step's device work ends inside its range
                point.step()
                sync(device)
    prof.export_chrome_trace(str(path))
    with open(path) as fh:
        return json.load(fh)


def wrap_metadata(backend) -> None:
    """The backend's eager metadata build inside the `attn_meta` range (an instance attribute: SGLang's call
    through the backend object lands here)."""
    from sglang_ernie55.profiling import forward_range

    orig = backend.init_forward_metadata

    def init_forward_metadata(forward_batch):
        with forward_range(ATTN_META):
            return orig(forward_batch)

    backend.init_forward_metadata = init_forward_metadata


# ------------------------------------------------------------------------------------------------- reporting
LABEL = {k: label for k, label, _ in COMPONENTS}


def _f(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def point_table(res: dict) -> str:
    g, e, fl, t = res.get("graph") or {}, res.get("eager") or {}, res["floors"], res["timed"]
    primary = g if g else e
    mode = "CUDA graph replay" if t.get("graph") else "eager"
    head = (
        f"### batch {res['batch']}, context {res['context']}: step {_f(t['step_ms'])} ms ({mode}; "
        f"{'CUDA events' if res['device'] == 'cuda' else 'host clock'}, median of {t['steps']}; wall "
        f"{_f(t['wall_ms'])} ms), {res['batch'] / t['step_ms'] * 1e3:.0f} tok/s; back to back without a sync "
        f"{_f(t['pipelined_ms'])} ms/step"
    )
    notes = []
    if g:
        notes.append(
            f"graph profile: span {_f(g['span_ms'])} ms, {g['items_per_step']:.0f} kernels/step "
            f"({g['graph_items_per_step']:.0f} replayed), {100 * (g['graph_match_fraction'] or 0):.0f}% of the "
            "replayed kernels matched to an eager kernel"
        )
    if e:
        notes.append(f"eager profile: span {_f(e['span_ms'])} ms, {e['items_per_step']:.0f} work items/step")
    lines = [head, "", "; ".join(notes), ""]
    cols = ["component", "kernels" if res["device"] == "cuda" else "ops"]
    if g:
        cols += ["graph ms", "%"]
    cols += ["eager ms", "MB", "byte floor ms", "GFLOP", "FLOP floor ms", "x floor"]
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    span = primary.get("span_ms") or 0.0
    primary_comp = primary.get("components", {})
    tot_bytes = tot_flops = tot_bfl = tot_ffl = 0.0
    for key in COMPONENT_KEYS:
        f = fl.get(key)
        pm = primary_comp.get(key, 0.0)
        row = [LABEL[key], f"{primary.get('items_per_component', {}).get(key, 0.0):.0f}"]
        if g:
            row += [_f(g["components"].get(key, 0.0)), f"{100 * pm / span:.1f}" if span else "-"]
        row += [_f(e["components"].get(key, 0.0)) if e else "-"]
        if f and (f["bytes"] or sum(f["flops"].values())):
            floor = max(f["byte_ms"], f["flop_ms"])
            row += [
                f"{f['bytes'] / 1e6:.1f}",
                _f(f["byte_ms"], 4),
                f"{sum(f['flops'].values()) / 1e9:.2f}",
                _f(f["flop_ms"], 4),
                f"{pm / floor:.1f}" if floor > 0 else "-",
            ]
            tot_bytes += f["bytes"]
            tot_flops += sum(f["flops"].values())
            tot_bfl += f["byte_ms"]
            tot_ffl += f["flop_ms"]
        else:
            row += ["-"] * 5
        lines.append("| " + " | ".join(row) + " |")
    gap_row = [
        "launch gaps (device idle)" if res["device"] == "cuda" else "gaps (host time between ops)",
        "-",
    ]
    if g:
        gap_row += [_f(g["gaps_ms"]), f"{100 * g['gaps_ms'] / span:.1f}" if span else "-"]
    gap_row += [_f(e.get("gaps_ms")) if e else "-"] + ["-"] * 5
    lines.append("| " + " | ".join(gap_row) + " |")
    step = t["step_ms"]
    tot = [
        "**total** (profiled span; x floor: timed step / byte floor)",
        f"{primary.get('items_per_step', 0):.0f}",
    ]
    if g:
        tot += [_f(g["span_ms"]), "100"]
    tot += [_f(e.get("span_ms")) if e else "-"]
    tot += [f"{tot_bytes / 1e6:.1f}", _f(tot_bfl, 4), f"{tot_flops / 1e9:.2f}", _f(tot_ffl, 4)]
    tot += [f"**{step / tot_bfl:.1f} x byte floor**" if tot_bfl else "-"]
    lines.append("| " + " | ".join(tot) + " |")
    return "\n".join(lines)


def summary_table(results: list[dict]) -> str:
    lines = [
        "| batch | context | step ms | mode | tok/s | back-to-back ms | byte floor ms | step / byte floor "
        "| largest components |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        t = r["timed"]
        bfl = sum(f["byte_ms"] for f in r["floors"].values())
        prim = (r.get("graph") or r.get("eager") or {}).get("components", {})
        top = sorted(prim.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"| {r['batch']} | {r['context']} | {_f(t['step_ms'])} | {'graph' if t.get('graph') else 'eager'} | "
            f"{r['batch'] / t['step_ms'] * 1e3:.0f} | {_f(t['pipelined_ms'])} | {_f(bfl, 4)} | "
            f"{t['step_ms'] / bfl:.1f} | " + ", ".join(f"{LABEL[k]} {v:.3f}" for k, v in top) + " |"
        )
    return "\n".join(lines)


def write_outputs(out: Path, meta: dict, results: list[dict], skipped: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(
        json.dumps(dict(meta=meta, points=results, skipped=skipped), indent=1)
    )
    md = [meta["headline"], "", summary_table(results), ""]
    for r in results:
        md += [point_table(r), ""]
    if skipped:
        md.append(f"Not measured (time budget): {skipped}")
    (out / "bench_step.md").write_text("\n".join(md) + "\n")


def pack_traces(out: Path, paths: list[Path]) -> None:
    """The traces of one point, gzipped, in one archive (skipped when too big to bring back)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in (p for p in paths if p.exists()):
            data = gzip.compress(p.read_bytes())
            info = tarfile.TarInfo(p.name + ".gz")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    if buf.tell() < (12 << 20):
        (out / "bench_step_traces.tar").write_bytes(buf.getvalue())


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,64,256)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths (default 4096,32768)")
    ap.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="server --context-length (default: max context + 1024)",
    )
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./bench_step_out)")
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="a checkpoint to serve (default: write the 4-layer full-width FP8 one)",
    )
    ap.add_argument("--layers", type=int, default=4, help="layers of the written full-width checkpoint")
    ap.add_argument(
        "--weights", default="fp8", choices=("fp8", "bf16"), help="format of the written checkpoint"
    )
    ap.add_argument(
        "--kv-cache-dtype", default=None, help="server --kv-cache-dtype (default: the server's, fp8_e4m3)"
    )
    ap.add_argument("--mem-fraction-static", type=float, default=0.85)
    ap.add_argument("--sampling-backend", default="pytorch")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per point")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per point first")
    ap.add_argument(
        "--profile-steps", type=int, default=3, help="profiled steps per point (graph and eager each)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=470.0, help="stop starting points after this many seconds"
    )
    ap.add_argument("--eager", action="store_true", help="no decode CUDA graphs (time eager steps)")
    ap.add_argument(
        "--server-arg", action="append", default=[], help="one more server flag or value (repeatable)"
    )
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny model on the CPU, batches 1,2, context 200"
    )
    a = ap.parse_args(argv)
    grid = SMOKE_GRID if a.cpu_smoke else FULL_GRID
    a.batches = [int(x) for x in a.batches.split(",")] if a.batches else list(grid["batches"])
    a.contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else list(grid["contexts"])
    if a.cpu_smoke:
        a.steps, a.warmup, a.profile_steps = min(a.steps, 2), min(a.warmup, 1), min(a.profile_steps, 1)
    a.context_length = a.context_length or max(a.contexts) + 1024
    return a


def make_ckpt(a, device: str, work: Path, progress=None) -> Path:
    """The checkpoint a benchmark serves (`a`: its checkpoint / cpu_smoke / layers / weights arguments): an
    existing `--checkpoint` as it is; else the random one (tiny on the CPU smoke, the full-width one otherwise)
    at `--checkpoint` or under `work`, reused when one of the same recipe is already there
    (`make_checkpoint(reuse=True)`; bench_serving.py shares the folder)."""
    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    if a.checkpoint and (Path(a.checkpoint) / "config.json").exists():
        return Path(a.checkpoint)
    target = (
        Path(a.checkpoint)
        if a.checkpoint
        else work / ("tiny" if a.cpu_smoke else f"fw{a.layers}-{a.weights}")
    )
    note = progress or (lambda m: print(f"[checkpoint] {m}", flush=True))
    if a.cpu_smoke:
        return make_checkpoint(target, preset="tiny", dtype="bf16", force=True, reuse=True, progress=note)
    path = make_checkpoint(
        target,
        preset="full-width",
        layers=a.layers,
        dtype=a.weights,
        device=device,
        force=True,
        reuse=True,
        progress=note,
    )
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def main(argv=None) -> int:
    a = parse_args(argv)
    device = "cpu" if a.cpu_smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not a.cpu_smoke:
        print("no CUDA device: run with --cpu-smoke for the CPU pipeline check")
        return 2
    os.environ["SGLANG_ERNIE55_PROFILE_RANGES"] = "1"
    from sglang_ernie55 import profiling

    profiling.ENABLED = True
    out = Path(a.out or os.environ.get("OUT") or "bench_step_out")
    # shared with bench_serving.py: a checkpoint one of them wrote is reused by the other
    work = Path(
        os.environ.get("BENCH_STEP_WORK") or os.environ.get("ERNIE55_BENCH_WORK", "/tmp/ernie55-bench")
    )
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    cal = calibrate(device)
    bw, rates = cal["copy_bytes_per_s"], cal["gemm_flops_per_s"]
    print(
        f"[calibration] copy {bw / 1e12:.3g} TB/s (read + write); GEMM TFLOP/s: "
        + ", ".join(f"{k} {v / 1e12:.3g}" for k, v in rates.items()),
        flush=True,
    )
    t = time.monotonic()
    ckpt = make_ckpt(a, device, work)
    ckpt_s = time.monotonic() - t

    from sglang_ernie55.configuration import SERVING_PAGE_SIZE

    steps_per_point = a.warmup + 2 * a.steps + 2 * (a.profile_steps + 1) + 8  # every step of measure_point
    per_req = (-(-(max(a.contexts) + steps_per_point) // SERVING_PAGE_SIZE) + 1) * SERVING_PAGE_SIZE
    max_tokens = max(a.batches) * per_req + 4 * SERVING_PAGE_SIZE
    argv = server_argv(a, ckpt, device, max_tokens)
    print("[server flags] " + " ".join(argv), flush=True)
    t = time.monotonic()
    runner, _sa = load_runner(argv)
    load_s = time.monotonic() - t
    cfg = runner.model_config.hf_config
    backend = ernie_backend(runner)
    wrap_metadata(backend)
    pool = runner.token_to_kv_pool
    t = time.monotonic()
    fill_pool(pool)
    sync(device)
    fill_s = time.monotonic() - t

    import sglang

    from sglang_ernie55.envs import layer_impl

    impls = {k: c.impl for k, c in getattr(backend, "choice", {}).items()}
    props = torch.cuda.get_device_properties(0) if device == "cuda" else None
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    headline = (
        f"Measured {stamp} on {props.name if props else 'CPU'}, torch {torch.__version__}, SGLang "
        f"{sglang.__version__}; {cfg.num_hidden_layers} layers ({', '.join(cfg.layer_types)}), "
        f"{'FP8' if getattr(runner.model_config, 'quantization', None) else 'BF16'} weights, KV "
        f"{getattr(pool, 'kv_dtype', '?')}, attention {impls}, layer compute {layer_impl()}; context length "
        f"{a.context_length}; copy {bw / 1e12:.3g} TB/s, GEMM TFLOP/s "
        + ", ".join(f"{k} {v / 1e12:.3g}" for k, v in rates.items())
    )
    meta = dict(
        headline=headline,
        stamp=stamp,
        device=props.name if props else "cpu",
        torch=torch.__version__,
        sglang=sglang.__version__,
        server_flags=argv,
        layer_types=list(cfg.layer_types),
        attention=impls,
        layer_impl=layer_impl(),
        kv=getattr(pool, "kv_dtype", None),
        context_length=a.context_length,
        copy_bytes_per_s=bw,
        gemm_flops_per_s=rates,
        checkpoint_s=round(ckpt_s, 1),
        load_s=round(load_s, 1),
        pool_fill_s=round(fill_s, 1),
    )
    print(
        f"[ready] {headline}; checkpoint {ckpt_s:.0f} s, load + graphs {load_s:.0f} s, pool fill {fill_s:.1f} s",
        flush=True,
    )

    points = sorted(((B, c) for B in a.batches for c in a.contexts), key=lambda p: (p[0] * p[1], p[0]))
    results, skipped, last_cost = [], [], 0.0
    for B, ctx in points:
        elapsed = time.monotonic() - T0
        if results and elapsed + 1.5 * last_cost > a.budget_s:
            skipped.append([B, ctx])
            print(
                f"[skip] batch {B} context {ctx}: {elapsed:.0f} s spent, budget {a.budget_s:.0f} s",
                flush=True,
            )
            continue
        t = time.monotonic()
        try:
            res = measure_point(a, runner, cfg, pool, B, ctx, device, work, bw, rates)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print(f"[failed] batch {B} context {ctx}: the traceback above; next point", flush=True)
            skipped.append([B, ctx, "failed"])
            continue
        last_cost = time.monotonic() - t
        res["seconds"] = round(last_cost, 1)
        results.append(res)
        print("\n" + point_table(res) + "\n", flush=True)
        write_outputs(out, meta, results, skipped)
        pack_traces(out, [work / "graph.json", work / "eager.json"])
    write_outputs(out, meta, results, skipped)
    print("\n" + headline + "\n\n" + summary_table(results), flush=True)
    print(f"[done] {time.monotonic() - T0:.0f} s; {out / 'bench_step.md'}", flush=True)
    return 0


def measure_point(
    a, runner, cfg, pool, B: int, ctx: int, device: str, work: Path, bw: float, rates: dict
) -> dict:
    for trace in ("graph.json", "eager.json"):  # the traces packed after this point are this point's
        (work / trace).unlink(missing_ok=True)
    point = Point(runner, B, ctx, cfg.vocab_size, cfg.bos_token_id or 1, seed=B * 7919 + ctx)
    for _ in range(a.warmup):
        point.step()
    sync(device)
    timed = timed_steps(point, a.steps, device)
    res = dict(batch=B, context=ctx, device=device, timed=timed)
    res["eager"] = res["graph"] = None
    reference = None
    try:
        with Eager(runner):
            if device == "cuda":
                point.step()  # eager warm-up: shapes the graphs never ran
            res["eager"], reference = breakdown(profiled(point, a.profile_steps, device, work / "eager.json"))
    except Exception as e:  # noqa: BLE001
        print(f"[eager profile failed: {type(e).__name__}: {str(e)[:200]}]", flush=True)
    if device == "cuda" and timed["graph"]:
        try:
            res["graph"], _ = breakdown(
                profiled(point, a.profile_steps, device, work / "graph.json"), reference
            )
        except Exception as e:  # noqa: BLE001
            print(
                f"[graph profile failed: {type(e).__name__}: {str(e)[:200]}; eager breakdown only]",
                flush=True,
            )
    fl = floors(runner.model, cfg, pool, B, ctx)
    res["floors"] = {k: f.to_dict(bw, rates) for k, f in fl.items()}
    return res


if __name__ == "__main__":
    sys.exit(main())
