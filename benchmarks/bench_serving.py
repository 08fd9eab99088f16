"""Throughput under a real client: SGLang's own load generator (`python -m sglang.benchmark.serving`, the
former `sglang.bench_serving`) against a real ERNIE-5.5 server started with `sglang.launch_server`.

Server configurations (`--configs`):
  base        no speculative decoding, on the random-weight checkpoint
  echo        ECHO (EAGLE chain of `--echo-steps` drafts) on the same checkpoint: random weights, so nearly
              every draft is rejected: ECHO's overhead
  echo-exact  ECHO on the ECHO-exact copy of the checkpoint (`echo_exact_copy`: every draft is accepted by
              construction, at full attention / MoE cost): ECHO's upper bound

Workloads, each as one `sglang.benchmark.serving` run against each server:
  random 1K-in / 1K-out (`--dataset-name random-ids --tokenize-prompt`: exact token counts, no dataset
  download) at each `--concurrency`, and a shared-prefix workload (`generated-shared-prefix`: groups of
  prompts behind one long system prompt, so the radix cache serves the prefix).

  long prompt: `--long-prompts` prompts of `--long-len` random tokens (default 32K) one at a time, one output
  token each (the `base` server only): time to first token under the server's own chunked prefill, read as
  each request's end-to-end latency (`one_token_ttft`).

  After the long-prompt run, one more long prompt runs under SGLang's own profiler (`/start_profile`): its
  kernels are attributed to the model's named ranges (bench_step's parser; the `base` server starts with
  SGLANG_ERNIE55_PROFILE_RANGES=1, which leaves CUDA-graph decode steps unchanged) and printed as time per
  component beside the end-to-end latency (`--no-prefill-profile` skips it).

  The random and long-prompt runs flush the server's radix cache after the client's warm-up request (SGLang's
  `--flush-cache`), which repeats the first prompt: otherwise that prompt's prefill is a cache hit.

Next to each `base` random row: the decode weight-byte roofline at that concurrency, batch C reading every
dense / attention / shared weight once plus the experts C tokens touch (E (1 - (1 - k/E)^C) of E), at the
copy bandwidth measured on this device (KV reads left out: at 1K-2K tokens of context they are a few % of
the weights). Output tok/s <= C / (those bytes / bandwidth); the ratio column is measured / roofline. Next to
the long-prompt row: the prefill FLOP floor, every Linear's FLOPs for the prompt's tokens (the routed experts' at
k/E, the LM head's for the last token only) plus each layer's attention FLOPs summed over the prompt's positions
(`bench_step.attention_flops`), at the GEMM rates measured on this device (fp8 / bf16 / fp32 by the weights'
dtype; attention at the bf16 rate); its ratio column is median TTFT / that floor.

  python3 benchmarks/bench_serving.py --out /tmp/bs                 # GPU: 4-layer full-width FP8 checkpoint
  python3 benchmarks/bench_serving.py --cpu-smoke --out /tmp/bs     # CPU: tiny checkpoint, short requests
  python3 benchmarks/bench_serving.py --table a/bench_serving.jsonl b/bench_serving.jsonl   # merge runs

The accept length column is SGLang's own (its /server_info): the mean over the server's life so far,
updated at its decode log interval (40 steps), so the first short runs show none.

The client's tokenizer is the checkpoint's tokenizer files alone: transformers' AutoTokenizer would read the
checkpoint's config.json and fail on its model type, which only the server's plugin registers. (Against a
real ERNIE-5.5 server do the same: point `--tokenizer` at a folder holding only the tokenizer files.)

Writes `bench_serving.jsonl` (one line per run, SGLang's metrics plus ours) and `bench_serving.md` under
`--out`; each server's log sits next to them. Progress lines go to stdout as it works.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = ("base", "echo", "echo-exact")
RESULT_FILE = "bench_serving.jsonl"
TABLE_FILE = "bench_serving.md"
# SGLang's metrics kept per run (its JSONL line also holds the whole server_info)
KEEP = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "accept_length",
    "max_concurrent_requests",
)


def say(t0: float, msg: str) -> None:
    print(f"[bench_serving {time.monotonic() - t0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="serve this checkpoint (default: write a random one, see --layers)")
    p.add_argument("--layers", type=int, default=4, help="layers of the full-width checkpoint written (GPU)")
    p.add_argument("--weights", choices=("fp8", "bf16"), default="fp8", help="its weight format")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny checkpoint on a CPU server, short requests")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS}")
    p.add_argument("--echo-steps", type=int, default=2, help="ECHO draft steps (the chain length)")
    p.add_argument("--concurrency", default=None, help="comma list (default 1,16,64; CPU smoke 1,2)")
    p.add_argument(
        "--input-len", type=int, default=None, help="random prompt tokens (default 1024; smoke 48)"
    )
    p.add_argument("--output-len", type=int, default=None, help="tokens generated (default 1024; smoke 8)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per concurrency (default max(4, 2 x C))")
    p.add_argument("--no-shared-prefix", action="store_true", help="skip the shared-prefix workload")
    p.add_argument("--long-len", type=int, default=None, help="long-prompt tokens (default 32768; smoke 300)")
    p.add_argument("--long-prompts", type=int, default=None, help="long prompts, one at a time (3; smoke 2)")
    p.add_argument("--no-long-prompt", action="store_true", help="skip the long-prompt (TTFT) workload")
    p.add_argument(
        "--no-prefill-profile",
        action="store_true",
        help="skip the one profiled long prompt after the long-prompt workload (its time per component)",
    )
    p.add_argument("--gsp-groups", type=int, default=None, help="shared-prefix groups (default 8; smoke 2)")
    p.add_argument("--gsp-prompts", type=int, default=None, help="prompts per group (default 8; smoke 2)")
    p.add_argument("--gsp-system-len", type=int, default=None, help="shared prefix tokens (2048; smoke 300)")
    p.add_argument("--gsp-question-len", type=int, default=None, help="own tokens per prompt (128; smoke 16)")
    p.add_argument("--gsp-output-len", type=int, default=None, help="tokens generated (256; smoke 8)")
    p.add_argument(
        "--gsp-concurrency", type=int, default=None, help="shared-prefix concurrency (16; smoke 2)"
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag(s) for every server: --server-arg '--tp 2', or --server-arg=--enable-x for one flag alone",
    )
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no new server or run after this many seconds (0: no limit); what ran is written",
    )
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_serving_out", help="output folder")
    p.add_argument(
        "--work",
        default=os.environ.get("ERNIE55_BENCH_WORK", "/tmp/ernie55-bench"),
        help="folder for the checkpoints written, shared with bench_step.py (default $ERNIE55_BENCH_WORK, else "
        "/tmp/ernie55-bench): a checkpoint already there from the same recipe is reused",
    )
    p.add_argument("--table", nargs="+", metavar="JSONL", help="only print the table of these result files")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    defaults = dict(
        concurrency="1,2" if smoke else "1,16,64",
        input_len=48 if smoke else 1024,
        output_len=8 if smoke else 1024,
        gsp_groups=2 if smoke else 8,
        gsp_prompts=2 if smoke else 8,
        gsp_system_len=300 if smoke else 2048,
        gsp_question_len=16 if smoke else 128,
        gsp_output_len=8 if smoke else 256,
        gsp_concurrency=2 if smoke else 16,
        long_len=300 if smoke else 32768,
        long_prompts=2 if smoke else 3,
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; legal: {', '.join(CONFIGS)}")
    try:
        a.concurrency = [int(c) for c in str(a.concurrency).split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency must be a comma list of integers, got {a.concurrency!r}")
    if not a.concurrency or min(a.concurrency) < 1:
        p.error("--concurrency: each level must be >= 1")
    if a.echo_steps < 1:
        p.error(f"--echo-steps must be >= 1, got {a.echo_steps}")
    a.server_arg = [tok for arg in a.server_arg for tok in arg.split()]
    return a


# ---------------------------------------------------------------------------------------------- roofline
def weight_bytes(ckpt: Path) -> dict:
    """From the safetensors headers: the bytes one decode step reads whatever the batch (every tensor but the
    embedding, which is gathered by row, and the ECHO layer's own), and per MoE layer the routed experts'
    bytes, their count and top-k."""
    import math

    from sglang_ernie55.checkpoint.loader import CheckpointReader

    reader = CheckpointReader(ckpt)  # scans the headers only
    fixed, experts = 0, {}
    for name, (shape, dtype) in reader.stored.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if name.startswith(("model.embed_tokens.", "echo.")):
            continue
        if ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            experts[layer] = experts.get(layer, 0) + nbytes
        else:
            fixed += nbytes
    cfg = reader.config
    return dict(
        fixed=fixed,
        experts_per_layer=list(experts.values()),
        E=cfg.n_routed_experts,
        k=cfg.num_experts_per_tok,
    )


def prefill_flops(ckpt: Path, T: int) -> dict[str, float]:
    """FLOPs of one T-token prefill by GEMM dtype class (see the module docstring): from the safetensors headers
    (every stored matrix but the embedding, the ECHO layer's and the quantisation scales) and the config."""
    import math

    from benchmarks.bench_step import _dtype_class, attention_flops
    from sglang_ernie55.checkpoint.loader import CheckpointReader

    reader = CheckpointReader(ckpt)
    cfg = reader.config
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    flops = {"fp8": 0.0, "bf16": 0.0, "fp32": 0.0}
    for name, (shape, dtype) in reader.stored.items():
        if (
            len(shape) < 2
            or name.startswith(("model.embed_tokens.", "echo."))
            or "scale" in name.rsplit(".", 1)[-1]
        ):
            continue
        tokens = 1 if name.startswith("lm_head.") else T  # logits of the last position only
        frac = k / E if ".mlp.experts." in name else 1.0
        flops[_dtype_class(dtype)] += 2.0 * tokens * math.prod(shape) * frac
    per_kind = {}
    for kind in cfg.layer_types:
        if kind not in per_kind:
            per_kind[kind] = sum(attention_flops(cfg, kind, L) for L in range(1, T + 1))
        flops["bf16"] += per_kind[kind]
    return flops


def flop_floor_ms(flops: dict[str, float], rates: dict[str, float]) -> float:
    return sum(f / rates[c] * 1e3 for c, f in flops.items() if f)


def roofline_tok_s(w: dict, batch: int, bw: float) -> tuple[float, float]:
    """(bytes one decode step of `batch` requests reads, the output tok/s that bound allows)."""
    from benchmarks.bench_step import experts_hit

    E, k = w["E"], w["k"]
    step = w["fixed"] + sum(b * experts_hit(E, k, batch) / E for b in w["experts_per_layer"])
    return step, batch / (step / bw)


# ---------------------------------------------------------------------------------------------- runs
def _progress_clock(t0: float):
    """The demo's server clock (its start-up progress lines), printing as this benchmark does."""
    from sglang_ernie55.cli import demo

    class Clock(demo._Clock):
        def say(self, msg: str) -> None:
            say(t0, msg)

    c = Clock()
    c.t0 = t0
    return c


def make_checkpoints(a, t0: float) -> dict[str, Path]:
    import torch

    from benchmarks.bench_step import make_ckpt
    from sglang_ernie55.reference.echo import echo_exact_copy

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    note = lambda m: say(t0, "  " + m)  # noqa: E731
    say(t0, "the checkpoint served" + ("" if a.checkpoint else f" (random, under {work})"))
    device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
    base = make_ckpt(a, device, work, progress=note)
    if {"base", "echo"} & set(a.configs):
        out["base"] = out["echo"] = base
    if "echo-exact" in a.configs:
        exact = work / f"{base.name}-echo-exact"
        if exact_is_current(base, exact):
            say(t0, f"reusing its ECHO-exact copy {exact} (made from this very checkpoint)")
        else:
            say(t0, f"writing its ECHO-exact copy {exact}")
            echo_exact_copy(base, exact, force=True, progress=note)
        out["echo-exact"] = exact
    return out


def exact_is_current(base: Path, exact: Path) -> bool:
    """The ECHO-exact copy at `exact` was made from the random checkpoint now at `base`: both complete, and the
    copy newer than the base's recipe (a base written again since is newer). A base without a recipe (a
    --checkpoint of the user's) is always copied again."""
    from sglang_ernie55.checkpoint.tiny import RECIPE_FILE

    recipe, made = base / RECIPE_FILE, exact / "echo_exact.json"
    return recipe.is_file() and made.is_file() and made.stat().st_mtime > recipe.stat().st_mtime


def server_flags(a, config: str) -> list[str]:
    from sglang_ernie55.cli.translate import echo_server_flags

    flags = list(echo_server_flags(a.echo_steps)) if config != "base" else []
    if a.cpu_smoke:
        # every level fits at once; a 2-page SWA share holds the window of two requests
        flags += ["--disable-cuda-graph", "--swa-full-tokens-ratio", "0.5", "--sampling-backend", "pytorch"]
    return flags + a.server_arg


def workloads(a) -> list[dict]:
    runs = []
    for c in a.concurrency:
        n = a.prompts or max(4, 2 * c)
        runs.append(
            dict(
                workload="random",
                concurrency=c,
                prompts=n,
                args=[
                    "--dataset-name",
                    "random-ids",
                    "--tokenize-prompt",
                    "--random-input-len",
                    str(a.input_len),
                    "--random-output-len",
                    str(a.output_len),
                    "--random-range-ratio",
                    "1.0",
                    "--num-prompts",
                    str(n),
                    "--max-concurrency",
                    str(c),
                    "--flush-cache",
                ],
            )
        )
    if not a.no_shared_prefix:
        n = a.gsp_groups * a.gsp_prompts
        runs.append(
            dict(
                workload="shared-prefix",
                concurrency=a.gsp_concurrency,
                prompts=n,
                args=[
                    "--dataset-name",
                    "generated-shared-prefix",
                    "--tokenize-prompt",
                    "--gsp-num-groups",
                    str(a.gsp_groups),
                    "--gsp-prompts-per-group",
                    str(a.gsp_prompts),
                    "--gsp-system-prompt-len",
                    str(a.gsp_system_len),
                    "--gsp-question-len",
                    str(a.gsp_question_len),
                    "--gsp-output-len",
                    str(a.gsp_output_len),
                    "--gsp-range-ratio",
                    "1.0",
                    "--num-prompts",
                    str(n),
                    "--max-concurrency",
                    str(a.gsp_concurrency),
                ],
            )
        )
    if not a.no_long_prompt:
        runs.append(
            dict(
                workload="long-prompt",
                concurrency=1,
                prompts=a.long_prompts,
                args=[
                    "--dataset-name",
                    "random-ids",
                    "--tokenize-prompt",
                    "--random-input-len",
                    str(a.long_len),
                    "--random-output-len",
                    "1",
                    "--random-range-ratio",
                    "1.0",
                    "--num-prompts",
                    str(a.long_prompts),
                    "--max-concurrency",
                    "1",
                    "--flush-cache",
                ],
            )
        )
    return runs


def tokenizer_dir(ckpt: Path, out: Path) -> Path:
    """The checkpoint's tokenizer files alone. The client loads its tokenizer through transformers'
    AutoTokenizer, which reads a config.json beside it and fails on the model type (only the server loads
    the ernie55 plugin that registers it); without one, tokenizer_config.json's class is used."""
    d = out / "client-tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens_map")) and f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    return d


def client_env(out: Path) -> dict:
    """The client's environment. SGLang's load generator imports Hugging Face `datasets` at start-up for its
    dataset workloads (SGLang depends on it); where it is missing, as in a trimmed runtime, a stand-in module
    that refuses those workloads lets the random ones run, which read no dataset."""
    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is not None:
        return env
    shim = out / "client-shim" / "datasets"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(
        "def load_dataset(*args, **kwargs):\n"
        "    raise RuntimeError('Hugging Face datasets is not installed: only the random workloads run here')\n"
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim.parent), env.get("PYTHONPATH", "")) if p)
    return env


PROFILE_DIR = "prefill-profile"


def profile_prefill(url: str, ckpt: Path, tokens: int, out: Path, device: str) -> dict:
    """One more prompt of `tokens` random ids (one output token, an empty radix cache) under SGLang's own
    profiler (`/start_profile`, `/stop_profile`, the trace written by the scheduler into --out/prefill-profile),
    its kernels attributed to the model's named ranges by bench_step's parser: the whole trace is one step, so
    `span_ms` runs from the first kernel's start to the last one's end (on the CPU: the scheduler's top-level ops),
    `gaps_ms` is the device idle inside it, and `e2e_ms` is the request's latency seen by this client."""
    import gzip
    import random

    import requests

    from benchmarks import bench_step

    d = out / PROFILE_DIR
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*.trace.json.gz"):
        old.unlink()
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = random.Random(tokens)
    ids = [rng.randrange(vocab) for _ in range(tokens)]
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()
    spec = dict(
        output_dir=str(d),
        activities=["CPU", "GPU"] if device == "cuda" else ["CPU"],
        with_stack=False,
        record_shapes=False,
    )
    requests.post(url + "/start_profile", json=spec, timeout=120).raise_for_status()
    t = time.monotonic()
    r = requests.post(
        url + "/generate",
        json=dict(input_ids=ids, sampling_params=dict(max_new_tokens=1, temperature=0.0)),
        timeout=1800,
    )
    e2e_ms = (time.monotonic() - t) * 1e3
    r.raise_for_status()
    requests.post(url + "/stop_profile", timeout=600).raise_for_status()
    deadline = time.monotonic() + 300
    traces: list[Path] = []
    while not traces and time.monotonic() < deadline:  # the scheduler writes it after answering
        traces = sorted(d.glob("*.trace.json.gz"))
        time.sleep(1)
    if not traces:
        raise RuntimeError(f"SGLang's profiler wrote no trace under {d}")
    time.sleep(2)  # a trace file still being written
    trace = json.loads(gzip.open(traces[-1]).read())
    _, items, on_device = bench_step.work_items(trace)
    if on_device:
        t0, t1 = min(w.start for w in items), max(w.start + w.dur for w in items)
    else:
        t0, t1 = min(w.launch for w in items), max(w.start + w.dur for w in items)
    summary = bench_step.summarize([items], [dict(ts=t0, dur=t1 - t0)], on_device)
    return dict(
        tokens=tokens,
        e2e_ms=e2e_ms,
        device=on_device,
        trace=str(traces[-1].relative_to(out)),
        **{k: summary[k] for k in ("span_ms", "busy_ms", "gaps_ms", "components", "items_per_component")},
        top_kernels=summary["top_kernels"],
        idle_by_range=summary.get("idle_by_range", {}),
        idle_largest=summary.get("idle_largest", []),
    )


def profile_table(p: dict, floor_ms: float | None) -> str:
    """The profiled long prompt: time per component (bench_step's rows) against its end-to-end latency."""
    from benchmarks.bench_step import COMPONENTS

    what = "kernels" if p["device"] else "host ops"
    lines = [
        f"Prefill profile, one prompt of {p['tokens']} tokens (SGLang's profiler; `{p['trace']}`): end to end "
        f"{p['e2e_ms']:.1f} ms; {'device' if p['device'] else 'host'} span {p['span_ms']:.1f} ms, busy "
        f"{p['busy_ms']:.1f} ms, idle {p['gaps_ms']:.1f} ms"
        + (f"; prefill FLOP floor {floor_ms:.1f} ms" if floor_ms else ""),
        "",
        f"| component | {what} | ms | % of busy | top {what} (ms) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    busy = p["busy_ms"] or 1.0
    for key, label, _ in COMPONENTS:
        ms = p["components"].get(key, 0.0)
        if not ms:
            continue
        top = ", ".join(f"{n[:48]} {v:.2f}" for n, v in p["top_kernels"].get(key, [])[:3])
        lines.append(
            f"| {label} | {p['items_per_component'][key]:.0f} | {ms:.2f} | {100 * ms / busy:.1f} | {top} |"
        )
    idle = p.get("idle_by_range") or {}
    if idle:
        from benchmarks.bench_step import IDLE_MIN_US

        lines += [
            "",
            f"Device idle inside the span, stretches of at least {IDLE_MIN_US:.0f} us, by the range of the "
            "kernel that ended each (host late: launched after the device went idle)",
            "",
            "| range | stretches | host late ms | launched before ms |",
            "| --- | ---: | ---: | ---: |",
        ]
        for rng, v in list(idle.items())[:8]:
            lines.append(
                f"| {rng} | {v['stretches']:.0f} | {v['host_late_ms']:.2f} | {v['launched_before_ms']:.2f} |"
            )
        big = ", ".join(
            f"{g['ms']:.2f} ms before {g['next'][:40]} ({g['range']}"
            + (", host late)" if g["host_late"] else ")")
            for g in p.get("idle_largest", [])[:4]
        )
        lines += ["", f"Largest: {big}"]
    return "\n".join(lines)


def one_token_ttft(res: dict) -> dict:
    """TTFT of a run whose requests generate one token: its end-to-end latency (the answer is that token).
    SGLang's client starts its TTFT clock only at the first chunk with non-empty text, which a single random
    token may not have (it then reports 0); the client's own figure is kept as `client_median_ttft_ms`."""
    return dict(
        client_median_ttft_ms=res["median_ttft_ms"],
        median_ttft_ms=res["median_e2e_latency_ms"],
        p99_ttft_ms=res["p99_e2e_latency_ms"],
    )


def unmeasured_timings(res: dict) -> dict:
    """A run in which no response chunk carried text (random tokens that decode to nothing until the end): SGLang's
    client then reports TTFT and ITL as 0 and a TPOT that includes the prefill. Those fields become None (printed
    '-') with `timings` saying why; other runs are left as they are ({})."""
    if res.get("median_ttft_ms") or res.get("median_itl_ms") or not res.get("completed"):
        return {}
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms")
    return {k: None for k in keys} | {
        "timings": "no response chunk carried text: TTFT / TPOT / ITL not measured"
    }


def run_client(url: str, ckpt: Path, run: dict, out: Path, tag: str) -> dict:
    """One `sglang.benchmark.serving` run; its JSONL line, reduced to KEEP."""
    res_file = out / f"client-{tag}.jsonl"
    res_file.unlink(missing_ok=True)
    tok = str(tokenizer_dir(ckpt, out))
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url]
    cmd += ["--tokenizer", tok, "--model", tok, "--seed", "1", "--disable-tqdm"]
    cmd += ["--output-file", str(res_file), *run["args"]]
    with open(out / f"client-{tag}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600, env=client_env(out))
    text = res_file.read_text() if res_file.exists() else ""
    if proc.returncode != 0 or not text.strip():
        tail = (out / f"client-{tag}.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(
            f"sglang.benchmark.serving exited {proc.returncode} ({tag}); its log's last lines:\n  "
            + "\n  ".join(tail)
        )
    line = json.loads(text.strip().splitlines()[-1])
    return {k: line.get(k) for k in KEEP}


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.table:
        rows = [json.loads(ln) for f in a.table for ln in Path(f).read_text().splitlines() if ln.strip()]
        print(table(rows))
        return 0
    t0 = time.monotonic()
    import sglang
    import torch

    from benchmarks.bench_step import calibrate
    from sglang_ernie55.cli import demo
    from sglang_ernie55.ports import free_port

    device = "cpu" if a.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU pipeline check")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cal = calibrate(device)
    bw, rates = cal["copy_bytes_per_s"], cal["gemm_flops_per_s"]
    name = torch.cuda.get_device_properties(0).name if device == "cuda" else "CPU"
    say(t0, f"{name}: copy bandwidth {bw / 1e12:.3g} TB/s (read + write), SGLang {sglang.__version__}")
    ckpts = make_checkpoints(a, t0)
    w = weight_bytes(ckpts.get("base") or ckpts["echo-exact"])
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows: list[dict] = []
    skipped: list[str] = []
    failed = ""
    for config in a.configs:
        if failed:
            skipped.append(f"{config}: every run (an earlier failure)")
            continue
        if a.budget_s and time.monotonic() - t0 > a.budget_s:
            skipped.append(f"{config}: every run (budget)")
            continue
        ckpt = ckpts[config]
        port = free_port()
        cmd = demo.server_command(ckpt, port, device == "cpu", server_flags(a, config))
        log_path = out / f"server-{config}.log"
        say(t0, f"[{config}] starting: {' '.join(cmd[2:])}")
        profiling = config == "base" and not (a.no_long_prompt or a.no_prefill_profile)
        # the model's named ranges (read at import in the scheduler process): eager forwards open a range per
        # component, CUDA-graph replays run none, so decode steps are unchanged
        os.environ["SGLANG_ERNIE55_PROFILE_RANGES"] = "1" if profiling else "0"
        try:
            server = demo.Server(cmd, log_path)
        finally:
            os.environ.pop("SGLANG_ERNIE55_PROFILE_RANGES")
        clock = _progress_clock(t0)
        try:
            demo._wait_ready(server, f"http://127.0.0.1:{port}", a.start_timeout, clock)
            startup = time.monotonic() - server.started
            for run in workloads(a):
                if run["workload"] == "long-prompt" and config != "base":
                    continue
                tag = f"{config}-{run['workload']}-c{run['concurrency']}"
                if a.budget_s and time.monotonic() - t0 > a.budget_s:
                    skipped.append(f"{tag} (budget)")
                    continue
                say(
                    t0,
                    f"[{config}] {run['workload']}: {run['prompts']} prompts at concurrency {run['concurrency']}",
                )
                res = run_client(f"http://127.0.0.1:{port}", ckpt, run, out, tag)
                row = dict(
                    stamp=stamp,
                    device=name,
                    sglang=sglang.__version__,
                    checkpoint=ckpt.name,
                    config=config,
                    echo_steps=a.echo_steps if config != "base" else 0,
                    workload=run["workload"],
                    concurrency=run["concurrency"],
                    prompts=run["prompts"],
                    server_start_s=round(startup, 1),
                    copy_bytes_per_s=bw,
                    **res,
                )
                if config == "base" and run["workload"] == "random":
                    row["step_weight_bytes"], row["roofline_tok_s"] = roofline_tok_s(
                        w, run["concurrency"], bw
                    )
                if run["workload"] != "long-prompt":
                    row.update(unmeasured_timings(res))
                else:
                    row.update(one_token_ttft(res))
                    row["prefill_tokens"] = a.long_len
                    row["prefill_flops"] = prefill_flops(ckpt, a.long_len)
                    row["prefill_flop_floor_ms"] = flop_floor_ms(row["prefill_flops"], rates)
                    row["gemm_flops_per_s"] = rates
                    if profiling:
                        say(t0, f"[{config}] one more long prompt under SGLang's profiler")
                        row["prefill_profile"] = profile_prefill(
                            f"http://127.0.0.1:{port}", ckpt, a.long_len, out, device
                        )
                rows.append(row)
                with open(out / RESULT_FILE, "a") as f:
                    f.write(json.dumps(row) + "\n")
                say(
                    t0,
                    f"[{config}] {tag}: {res['completed']}/{run['prompts']} completed, "
                    f"{res['output_throughput']:.1f} output tok/s, median TTFT {_f(row['median_ttft_ms'], '.0f')} ms, "
                    f"median ITL {_f(row['median_itl_ms'], '.1f')} ms"
                    + (f", accept length {res['accept_length']:.2f}" if res.get("accept_length") else ""),
                )
        except (demo.DemoFailed, RuntimeError) as e:  # a server that did not start, a client that failed
            failed = str(e)
            print(failed, flush=True)
        finally:
            say(t0, f"[{config}] server {server.stop()}")
    text = table(rows) + "".join(
        "\n\n" + profile_table(r["prefill_profile"], r.get("prefill_flop_floor_ms"))
        for r in rows
        if r.get("prefill_profile")
    )
    if skipped:
        text += "\n\nNot run: " + "; ".join(skipped)
    (out / TABLE_FILE).write_text(text + "\n")
    print(text, flush=True)
    if failed:
        return 1
    incomplete = [r for r in rows if r["completed"] != r["prompts"]]
    if incomplete:
        print(f"{len(incomplete)} run(s) did not complete every prompt: see the client logs under {out}")
        return 1
    return 0


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)"
    head = rows[0]
    lines = [
        f"SGLang {head['sglang']} on {head['device']}, measured {head['stamp']}; checkpoint {head['checkpoint']}; "
        f"copy bandwidth {head['copy_bytes_per_s'] / 1e12:.3g} TB/s",
        "",
        "| config | workload | concurrency | prompts | completed | output tok/s | median TTFT ms | p99 TTFT ms "
        "| median TPOT ms | median ITL ms | p99 ITL ms | accept length (server mean so far) "
        "| weight-byte roofline tok/s | of roofline | prefill FLOP floor ms | median TTFT / floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        roof, floor = r.get("roofline_tok_s"), r.get("prefill_flop_floor_ms")
        lines.append(
            f"| {r['config']}{' x' + str(r['echo_steps']) if r['echo_steps'] else ''} | {r['workload']} | "
            f"{r['concurrency']} | {r['prompts']} | {r['completed']} | {_f(r['output_throughput'], '.1f')} | "
            f"{_f(r['median_ttft_ms'], '.0f')} | {_f(r['p99_ttft_ms'], '.0f')} | {_f(r['median_tpot_ms'], '.2f')} | "
            f"{_f(r['median_itl_ms'], '.2f')} | {_f(r['p99_itl_ms'], '.2f')} | {_f(r['accept_length'], '.2f')} | "
            f"{_f(roof, '.0f')} | {_f(r['output_throughput'] / roof if roof else None, '.2f')} | "
            f"{_f(floor, '.1f')} | {_f(r['median_ttft_ms'] / floor if floor and r['median_ttft_ms'] else None, '.1f')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
