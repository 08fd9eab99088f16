"""GPU: the ECHO draft extend recorded in a real CUDA graph through SGLang's `EAGLEDraftExtendCudaGraphRunner`
(its own `capture_one_shape` / `execute`: static buffers, capture-time ForwardBatch, request padding, replay
metadata call), in-process on the tiny draft (fp32; experts as the dense static-shape stand-in of
test_draft_graph_cpu.py, since FusedMoE's Triton kernel needs a server context; the server suite
tests/echo/test_echo_gpu.py captures the whole thing with FusedMoE). The graph backend is `torch.cuda.CUDAGraph`
per batch size (warm-up on a side stream, then capture), which refuses any host sync in the forward.

Per last-layer kind, S in 1..3, pools with and without SWA slots: rounds of 3 requests (padded to 4), 1 (padded to
4) and 4 replayed from the graph equal the eager DRAFT_EXTEND_V2 forward (selected logits, draft streams, every
pool row; 1e-4), capture and padded rows touch only the padding page (test_draft_graph_cpu.graph_vs_eager_rounds).
Then the per-call time of the eager draft extend vs the graph `execute` (bs 1 and 4, S = 3) is printed and
recorded in `$OUT/echo-draft-graph.jsonl` (not asserted).

    bash scripts/gpu-suite.sh tests/echo/test_draft_graph_gpu.py
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from tests.echo import test_draft_graph_cpu as g

pytestmark = [pytest.mark.gpu]
OUT = Path(os.environ.get("OUT") or os.environ.get("SERVING_LOG_DIR") or "gpu-out")


class CudaGraphs:
    """The runner's graph backend as SGLang's full-graph backend does it, minus its shared memory pool: warm-up
    on a side stream, `torch.cuda.graph` capture, `replay()` returning the captured outputs."""

    def __init__(self, attn_backend):
        self.graphs: dict = {}
        self.replays = 0

    def capture_one(self, shape_key, run_once, capture_inputs=None, post_warmup_hook=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run_once()
        torch.cuda.current_stream().wait_stream(side)
        if post_warmup_hook is not None:
            post_warmup_hook()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_once()
        self.graphs[shape_key] = (graph, out)

    def replay(self, shape_key, forward_batch):
        graph, out = self.graphs[shape_key]
        graph.replay()
        self.replays += 1
        return out


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(scope="module", params=["hca", "mla_dsa"])
def cuda_draft(request):
    """The draft on the GPU. The world-1 group it needs sets MASTER_* / RANK / ... in os.environ; they are removed
    again so that servers started later by this pytest process (tests/echo/test_echo_gpu.py) do not inherit them."""
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    try:
        made = g.make_draft(request.param, "cuda")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield made
    del made
    torch.cuda.empty_cache()


@pytest.mark.parametrize("swa", [False, True], ids=["full-slots", "swa-slots"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_draft_extend_cuda_graph_equals_eager(cuda_draft, monkeypatch, steps, swa):
    cfg, draft = cuda_draft
    g.graph_vs_eager_rounds(
        monkeypatch,
        draft,
        cfg,
        steps,
        swa,
        device="cuda",
        graphs_cls=CudaGraphs,
        tol=1e-4,
        record_writes=False,
    )


WARMUP, TIMED = 5, 50


def _median_ms(fn) -> float:
    """fn(i) for i < WARMUP + TIMED; the median wall time of the timed calls, synchronized, in ms."""
    for i in range(WARMUP):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(WARMUP, WARMUP + TIMED):
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def test_draft_extend_time_eager_vs_graph(cuda_draft, monkeypatch):
    """Per-call wall time of one draft extend, eager vs replayed (recorded, not asserted)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    cfg, draft = cuda_draft
    steps = 3
    sess = g.session(draft, cfg, swa=True, device="cuda")
    g.prefill_history(sess, cfg)
    runner = g.build_runner(monkeypatch, sess, draft, cfg, steps, CudaGraphs)
    rec = {"kind": cfg.layer_types[-1], "steps": steps}
    for reqs in ([1], [1, 2, 3, 4]):
        b = g.round_batch(cfg, reqs, steps, seed=3, accept=[steps + 1] * len(reqs), device="cuda")
        # one batch object per call, built beforehand: `execute` repoints a padded batch's spec_info at its
        # buffers (SGLang hands it a new batch every round)
        fbs = [g.forward_batch_for(sess, b, reqs) for _ in range(WARMUP + TIMED)]

        def eager(i, b=b):
            with torch.no_grad():
                sess.run(ForwardMode.DRAFT_EXTEND_V2, b["reqs"], b["positions"], b["tokens"], b["streams"])

        def graph(i, b=b, fbs=fbs):
            runner.execute(fbs[i], b["select_index"])

        rec[f"bs{len(reqs)}"] = {"eager_ms": _median_ms(eager), "graph_ms": _median_ms(graph)}
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "echo-draft-graph.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    print("echo-draft-graph", json.dumps(rec), flush=True)
