"""The geometry matrix (tests/serving/geometries.py) on the GPU: the real SGLang server per variant, with decode
CUDA graphs on, in three modes:

| mode | server | oracle (the reference, teacher-forced, on the GPU) | pass |
| --- | --- | --- | --- |
| `bf16` | fp32 activations, bf16 KV | cached tensors rounded to bf16 as the pool stores them | every token within TIE_NATS of the oracle's top-1 (FusedMoE's Triton kernel computes fp32 inputs in fp16, so near-ties may flip), mean |logprob error| <= 0.005 |
| `fp8` | fp32 activations, fp8_e4m3 KV (where its layouts fit the geometry) | cached tensors through the fp8 byte layouts and their scales | first token within 0.05 nats on every prompt, top-1 >= 95%, mean |logprob error| <= 0.05 (tests/serving/test_server_gpu.py's fp8 criteria) |
| `fp8` where the fp8 layouts do not fit | none: `--kv-cache-dtype fp8_e4m3` must be refused at argument resolution naming the config field | | the refusal |
| `echo` | `bf16` plus ECHO (`--speculative-algorithm EAGLE --speculative-num-steps 2`; the draft path defaults to the model path), verify / draft CUDA graphs | as `bf16` | as `bf16` (speculative greedy output is the target's greedy output) |

At fp32 activations the `ernie55` backend's kernel path runs every dot in IEEE fp32, so the oracle rounds only
what the pool stores (as in test_server_gpu.py); which compute each layer kind ran on (Triton, or the torch twin
where the kernels do not take the geometry: window / ratio other than 128 / 128, widths that are not powers of
two) is read from each server's log and printed with its score.

Prompts per server: 19, 150 and 300 tokens concurrently, then the 300-token one again (a one-page prefix hit),
NEW_TOKENS greedy tokens each. Servers run GPU_CONCURRENCY at a time on the one GPU (each with
`--mem-fraction-static` from `server_harness.mem_fraction`, default 0.3, and a capped 16384-token pool, so that
the budget SGLang computes stays positive while the others allocate); scoring runs after, in this process.
Planned at ~6 minutes of one H200 (22 servers, ~1 min each cold, 6 at a time).

Run on the GPU machine, with `.gpu` (../shared/gpu/stage.sh) and `.peers` (scripts/stage-peers.sh: FlashMLA, which
SGLang's EAGLE worker imports when it captures the draft graphs, so the `echo` servers need it) staged and carried:

    bash scripts/gpu-suite.sh tests/serving/test_geometry_matrix_gpu.py

A failure names the variant, the mode, what it varies, the compute it ran on and the numbers; the per-server
table is printed at the end and written to $SERVING_LOG_DIR/serving-results.jsonl (or $OUT) when set.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.serving import geometries as G
from tests.serving import server_harness as sh

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="the geometry matrix's GPU half needs a CUDA GPU (none here); on a GPU machine run "
        "`bash scripts/gpu-suite.sh tests/serving/test_geometry_matrix_gpu.py`. Its CPU half is "
        "tests/serving/test_geometry_matrix_cpu.py",
    ),
]

NEW_TOKENS = 16
TIE_NATS = 0.01
MODES = ("bf16", "fp8", "echo")
CONCURRENCY = int(os.environ.get("GPU_CONCURRENCY", "6"))
SERVER_TIMEOUT_S = 420
COMMON = (
    *"--dtype float32 --context-length 2048 --max-running-requests 8 --chunked-prefill-size 512".split(),
    *"--max-total-tokens 16384 --sampling-backend pytorch --disable-prefill-cuda-graph".split(),
    *"--cuda-graph-max-bs-decode 4 --decode-log-interval 1".split(),
    *("--mem-fraction-static", sh.mem_fraction("0.3")),
)
MODE_FLAGS = {
    "bf16": tuple("--kv-cache-dtype bfloat16".split()),
    "fp8": tuple("--kv-cache-dtype fp8_e4m3".split()),
    "echo": tuple(
        "--kv-cache-dtype bfloat16 --speculative-algorithm EAGLE --speculative-num-steps 2".split()
    ),
}
CASES = [(v.name, m) for v in G.VARIANTS for m in MODES]


def _refused(v: G.Variant, mode: str) -> bool:
    return mode == "fp8" and bool(v.fp8_kv)


def _serve(v: G.Variant, mode: str, path: str) -> dict:
    prompts = G.prompts(v.config())
    t0 = time.time()
    server = sh.Server(
        path, *COMMON, *MODE_FLAGS[mode], log_name=f"geometry-gpu-{v.name}-{mode}", timeout=SERVER_TIMEOUT_S
    )
    try:
        outs = server.complete_all(prompts, NEW_TOKENS, workers=len(prompts))
        outs.append(server.complete(prompts[-1], NEW_TOKENS))  # the one-page prefix hit
        impls = server.attention_impls()
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    return {
        "prompts": prompts + [prompts[-1]],
        "outs": outs,
        "impls": impls,
        "startup_s": server.startup_s,
        "wall_s": time.time() - t0,
        # captured (the target's decode graph, or its verify graph under ECHO), and replayed by the decode
        # steps (each logged: --decode-log-interval 1)
        "cuda_graph": re.search(r"Capture target (decode|verify) CUDA graph end", log) is not None
        and re.search(r"Decode batch.*cuda graph: True", log) is not None,
        "cached": max((int(c) for c in re.findall(r"Prefill batch.*?#cached-token: (\d+)", log)), default=0),
        "log_path": str(server.log_path),
    }


def _run(v: G.Variant, mode: str, path: str) -> dict:
    try:
        return _serve(v, mode, path)
    except Exception:
        return {"error": traceback.format_exc()[-6000:]}


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """The selected (variant, mode) servers, GPU_CONCURRENCY at a time; refused fp8 cases start no server."""
    cases = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = (params.get("name"), params.get("mode"))
        if item.module is request.module and None not in case and case not in cases:
            cases.append(case)
    root = tmp_path_factory.mktemp("geometry-gpu-ckpt")
    paths = {n: G.write_checkpoint(G.BY_NAME[n], root) for n in dict.fromkeys(n for n, _ in cases)}
    todo = [(n, m) for n, m in cases if not _refused(G.BY_NAME[n], m)]
    with ThreadPoolExecutor(max(1, CONCURRENCY)) as ex:
        done = ex.map(lambda c: _run(G.BY_NAME[c[0]], c[1], paths[c[0]]), todo)
        results = dict(zip(todo, done))
    yield {"paths": paths, "results": results}
    print("\ngeometry matrix, GPU server (H200):")
    for n, m in cases:
        r = results.get(
            (n, m), {"line": "refused at argument resolution" if _refused(G.BY_NAME[n], m) else "-"}
        )
        print(f"  {n:24s} {m:5s} {r.get('line', 'server error' if 'error' in r else 'not scored')}")


def _score(path: str, mode: str, r: dict):
    cfg, ref = sh.load_reference(path, "cuda")
    kv = "fp8_e4m3" if mode == "fp8" else "bfloat16"
    with sh.kv_rounded_reference(kv, cfg):
        return sh.score(ref, r["prompts"], r["outs"], "cuda", eps=TIE_NATS)


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_geometry_served_on_gpu(name, mode, served):
    v = G.BY_NAME[name]
    tag = f"[{name} / {mode}] ({v.varies})"
    if _refused(v, mode):
        from sglang_ernie55.args import Ernie55ArgumentError, resolve_server_args

        with pytest.raises(Ernie55ArgumentError) as info:
            resolve_server_args(["--model-path", served["paths"][name], *COMMON, *MODE_FLAGS[mode]])
        value = getattr(v.config(), v.fp8_kv)
        assert f"config.json {v.fp8_kv} {value}" in str(info.value), f"{tag}: {info.value}"
        sh.write_report(f"geometry_gpu_{name}_{mode}", {"refused": str(info.value)})
        return
    r = served["results"][(name, mode)]
    assert "error" not in r, f"{tag}: the server failed:\n{r['error']}"
    s = _score(served["paths"][name], mode, r)
    r["line"] = (
        f"top-1 {s.top1}/{s.positions}, worst gap {s.worst_gap:.4f}, mean |lp err| {s.mean_lp_err:.4f} "
        f"(max {s.max_lp_err:.4f}), attention {r['impls']}, graphs {r['cuda_graph']}, prefix hit {r['cached']}, "
        f"startup {r['startup_s']:.0f} s"
    )
    print(f"\n{tag} {r['line']}")
    sh.write_report(
        f"geometry_gpu_{name}_{mode}",
        {
            "summary": s.summary(),
            "mismatches": s.mismatches,
            "impls": r["impls"],
            "startup_s": r["startup_s"],
        },
    )
    detail = f"{tag} attention {r['impls']}: {s.summary()}; first mismatches {s.mismatches[:4]}; log {r['log_path']}"
    assert r["cuda_graph"], f"{tag}: decode ran without CUDA graphs ({r['log_path']})"
    assert r["cached"] >= 256, f"{tag}: no prefix hit ({r['log_path']})"
    if mode == "fp8":
        firsts = [m for m in s.mismatches if m["pos"] == 0 and m["gap"] > 0.05]
        assert not firsts, f"{detail}; first token beyond a near-tie of 0.05 nats: {firsts}"
        assert s.top1 >= 0.95 * s.positions and s.mean_lp_err <= 0.05, detail
    else:
        assert s.worst_gap <= TIE_NATS and s.mean_lp_err <= 0.005, detail
