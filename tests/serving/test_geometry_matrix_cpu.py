"""The geometry matrix (tests/serving/geometries.py) on the real SGLang server, on CPU.

For every variant: a tiny BF16 checkpoint of that geometry, `python -m sglang.launch_server --device cpu`
(fp32 activations, the torch twin of the `ernie55` backend, SGLang's hybrid-SWA pool), three concurrent
greedy prompts of 19 / 150 / 300 tokens (longer than every window and compress ratio of the matrix, so
compressed blocks complete; 300 crosses the 256-token page) and then the 300-token prompt again (a one-page
prefix hit, checked in the log), NEW_TOKENS tokens each. Scored teacher-forced against the reference whose
cached tensors are rounded to bf16 as the pool stores them (`server_harness.kv_rounded_reference`).

Pass: top-1 >= 99% of positions and mean |logprob error| <= 0.005.

KV dtype: variants whose widths the fp8_e4m3 layouts take are served with `--kv-cache-dtype bfloat16` (the
dtype of the exact oracle); the others are served with the flag left out, so the model's default must route
them to bfloat16 by itself (the log line naming the field is checked). That an explicit fp8_e4m3 is refused
for them at argument resolution is checked without a server in tests/test_geometry_kv_rules.py.

Memory: every variant but one runs in a capped pool (MEMORY_FLAGS). DEFAULT_MEMORY_VARIANT (the user's
checkpoint) is served with SGLang's default memory flags and no KV dtype flag, as `sglang serve
--model-path <it> --device cpu` would. On CPU SGLang then sizes the KV pool from the host's free memory
(`get_available_gpu_memory("cpu")` = psutil's available memory / NUMA nodes, and the GPU rule
mem_fraction_static = (capacity - reserve) / capacity), whatever the context length and request cap: on a 24 GB
host with 19 GB free it allocated a 17.3 GB pool (22.9M tokens for a server admitting 4 requests of 1024
tokens), leaving under 3 GB to the host, and zero-filling it took 17 s. It works, and the test checks that it
serves exactly, that the pool stays below the free memory it was sized from, and that the server logs the
memory-budget decision; it is not reasonable on a shared machine, so that server runs alone (after the others)
and its processes are made the kernel's first OOM victims (oom_first_shim), and a deployment on CPU should
pass --max-total-tokens.

Time: a server is SGLang's three processes importing SGLang, most of its cost; SERVING_CPU_CONCURRENCY (default 2)
capped servers run at once, which fills the second core while the other server imports single-threaded. Measured
on a shared 2-core box with other suites running (load 5): 75-120 s to start each, the whole file 9.2 min. Results
per variant are printed as a table (and written to $SERVING_LOG_DIR/serving-results.jsonl when set).
"""

from __future__ import annotations

import os
import re
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serving import geometries as G
from tests.serving import server_harness as sh
from tests.shim_lib.ernie55_shim_lib import shim_pythonpath

pytestmark = [pytest.mark.slow]

NEW_TOKENS = 6
TOP1_MIN, MEAN_LP_MAX = 0.99, 0.005
DEFAULT_MEMORY_VARIANT = "odd_mla_dims"
CPU_FLAGS = (
    *"--device cpu --dtype float32 --context-length 1024 --max-running-requests 4 --chunked-prefill-size 256".split(),
    *"--disable-cuda-graph --disable-prefill-cuda-graph --sampling-backend pytorch".split(),
)
# 4096 full tokens, 2048 SWA tokens: three concurrent prompts each pin a 256-token SWA page per request
MEMORY_FLAGS = ("--max-total-tokens", "4096", "--swa-full-tokens-ratio", "0.5")
CONCURRENCY = int(os.environ.get("SERVING_CPU_CONCURRENCY", "2"))
SHIM = Path(__file__).resolve().parent / "oom_first_shim"
ROUTED_NOTE = "-> bfloat16, not the model's default fp8_e4m3: "  # overrides.py's log line


def server_flags(v: G.Variant) -> list[str]:
    flags = list(CPU_FLAGS)
    if v.name != DEFAULT_MEMORY_VARIANT:
        flags += MEMORY_FLAGS
    if not v.fp8_kv:
        flags += ["--kv-cache-dtype", "bfloat16"]
    return flags


def _serve(v: G.Variant, path: str) -> dict:
    """Start, send the prompts, stop; the raw answers and what the log says (scored later, in the main thread:
    the rounded reference patches module globals)."""
    cfg = v.config()
    prompts = G.prompts(cfg)
    env = {}
    if v.name == DEFAULT_MEMORY_VARIANT:
        env["PYTHONPATH"] = shim_pythonpath(SHIM)
    t0 = time.time()
    free_before = _available_bytes()
    server = sh.Server(path, *server_flags(v), log_name=f"geometry-cpu-{v.name}", timeout=600, env=env)
    try:
        outs = server.complete_all(prompts, NEW_TOKENS, workers=len(prompts))
        outs.append(server.complete(prompts[-1], NEW_TOKENS))  # the one-page prefix hit
    finally:
        server.stop()
    return {
        "prompts": prompts + [prompts[-1]],
        "outs": outs,
        "startup_s": server.startup_s,
        "wall_s": time.time() - t0,
        "log": server.log_path.read_text(errors="replace"),
        "log_path": str(server.log_path),
        "free_before": free_before,
    }


def _available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def _run(v: G.Variant, path: str) -> dict:
    try:
        return _serve(v, path)
    except Exception:
        return {"error": traceback.format_exc()[-6000:]}


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """Every selected variant served once: the capped ones CONCURRENCY at a time, then the default-memory one
    alone (it takes most of the host's free memory)."""
    names = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and params.get("name") not in (None, *names):
            names.append(params["name"])
    root = tmp_path_factory.mktemp("geometry-ckpt")
    paths = {n: G.write_checkpoint(G.BY_NAME[n], root) for n in names}
    capped = [n for n in names if n != DEFAULT_MEMORY_VARIANT]
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max(1, CONCURRENCY)) as ex:
        for n, r in zip(capped, ex.map(lambda n: _run(G.BY_NAME[n], paths[n]), capped)):
            results[n] = r
    if DEFAULT_MEMORY_VARIANT in names:
        results[DEFAULT_MEMORY_VARIANT] = _run(
            G.BY_NAME[DEFAULT_MEMORY_VARIANT], paths[DEFAULT_MEMORY_VARIANT]
        )
    yield {"paths": paths, "results": results}
    print("\ngeometry matrix, CPU server:")
    for n in names:
        r = results[n]
        print(f"  {n:24s} {r.get('line', 'error' if 'error' in r else 'not scored')}")


def _prefix_hits(log: str) -> list[int]:
    return [int(c) for c in re.findall(r"Prefill batch.*?#cached-token: (\d+)", log)]


@pytest.mark.parametrize("name", [v.name for v in G.VARIANTS])
def test_geometry_served_on_cpu(name, served):
    v = G.BY_NAME[name]
    r = served["results"][name]
    assert "error" not in r, f"[{name}] ({v.varies}) the server failed:\n{r['error']}"
    log = r["log"]
    assert re.search(r"ernie55 attention backend: \w+ layers run on torch", log), (
        f"[{name}] backend line missing"
    )
    if v.fp8_kv:
        # the default KV dtype of a checkpoint the fp8 layouts cannot tile: bfloat16, logged with the field
        assert ROUTED_NOTE in log, f"[{name}] no routing note ({ROUTED_NOTE!r}) in {r['log_path']}"
        note = log.split(ROUTED_NOTE, 1)[1].splitlines()[0]
        assert f"config.json {v.fp8_kv} " in note, f"[{name}] the routing note names no {v.fp8_kv}: {note}"
    assert "kv=bfloat16" in log, f"[{name}] the pool is not bfloat16 ({r['log_path']})"
    assert max(_prefix_hits(log), default=0) >= 256, f"[{name}] no prefix hit: {_prefix_hits(log)}"

    _, ref = sh.load_reference(served["paths"][name], "cpu")
    with sh.kv_rounded_reference():
        s = sh.score(ref, r["prompts"], r["outs"], "cpu")
    r["line"] = (
        f"top-1 {s.top1}/{s.positions}, mean |lp err| {s.mean_lp_err:.4f} (max {s.max_lp_err:.4f}), "
        f"startup {r['startup_s']:.0f} s, wall {r['wall_s']:.0f} s"
    )
    sh.write_report(
        f"geometry_cpu_{name}",
        {
            "varies": v.varies,
            "summary": s.summary(),
            "mismatches": s.mismatches,
            "startup_s": r["startup_s"],
            "wall_s": r["wall_s"],
        },
    )
    print(f"\n[{name}] {r['line']}")
    assert s.top1 >= TOP1_MIN * s.positions and s.mean_lp_err <= MEAN_LP_MAX, (
        f"[{name}] ({v.varies}): {s.summary()}; first mismatches {s.mismatches[:4]}; log {r['log_path']}"
    )

    if name == DEFAULT_MEMORY_VARIANT:
        m = re.search(r"ERNIE-5.5 KV pool: full_tokens=(\d+) .*? bytes=(\d+)", log)
        assert m and "(memory budget)" in log, f"[{name}] pool lines missing ({r['log_path']})"
        full_tokens, pool_bytes = int(m[1]), int(m[2])
        print(
            f"[{name}] SGLang's default CPU sizing: {full_tokens} full tokens, pool {pool_bytes / 2**30:.2f} GiB "
            f"of {r['free_before'] / 2**30:.2f} GiB available before the server started"
        )
        sh.write_report(
            f"geometry_cpu_default_memory_{name}",
            {"full_tokens": full_tokens, "pool_bytes": pool_bytes, "available_before": r["free_before"]},
        )
        assert pool_bytes < r["free_before"], (pool_bytes, r["free_before"])
