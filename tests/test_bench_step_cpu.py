"""benchmarks/bench_step.py on the CPU: the trace attribution on hand-made profiler traces (eager launches, a
replayed CUDA graph aligned to its eager twin, nested host ops), the floors' arithmetic, the ranges being off by
default, and `--cpu-smoke` end to end (the tiny model on SGLang's ModelRunner, the model's ranges, the
profiler, the table): every component row is there, non-negative, and the components fit in the step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_step as bs

ROOT = Path(__file__).resolve().parents[1]


class Trace:
    """A Chrome trace in torch.profiler's format: ranges and launches on one host thread, kernels on a stream."""

    def __init__(self):
        self.events = []
        self.corr = 0

    def range(self, name, ts, dur):
        self.events.append(dict(ph="X", cat="user_annotation", name=name, pid=10, tid=11, ts=ts, dur=dur))

    def op(self, name, ts, dur):
        self.events.append(dict(ph="X", cat="cpu_op", name=name, pid=10, tid=11, ts=ts, dur=dur))

    def launch(self, ts, kernels, api="cudaLaunchKernel", cat="cuda_runtime"):
        """One launch at host time ts of kernels [(name, start, dur)] (several: a graph launch)."""
        self.corr += 1
        self.events.append(
            dict(ph="X", cat=cat, name=api, pid=10, tid=11, ts=ts, dur=1, args={"correlation": self.corr})
        )
        for name, start, dur in kernels:
            self.kernel(name, start, dur, self.corr)

    def kernel(self, name, start, dur, corr):
        self.events.append(
            dict(ph="X", cat="kernel", name=name, pid=0, tid=7, ts=start, dur=dur, args={"correlation": corr})
        )

    def json(self):
        return {"traceEvents": self.events}


def eager_trace():
    """One eager step (0..100 us): embed, an HCA layer (projection + attention), a MoE routing and expert
    kernel, the LM head, sampling; one kernel outside every range."""
    t = Trace()
    t.range(bs.STEP_RANGE, 0, 100)
    t.range("ernie55.embed", 1, 4)
    t.launch(2, [("embed_k", 10, 2)])
    t.range("ernie55.hca", 6, 20)
    t.launch(7, [("gemm_a", 13, 5)])
    t.range("ernie55.attn_meta", 9, 3)  # a range nested in another: the inner one wins
    t.launch(10, [("meta_k", 19, 1)])
    t.launch(20, [("flash_k", 21, 10)], api="cuLaunchKernel", cat="cuda_driver")
    t.range("ernie55.moe", 30, 20)
    t.range("ernie55.moe.route", 31, 5)
    t.launch(32, [("topk_k", 33, 3)])
    t.range("ernie55.moe.experts", 40, 5)
    t.launch(41, [("fused_moe_k", 42, 8)])
    t.launch(47, [("add_k", 51, 1)])  # inside moe, outside its children: `other`
    t.range("ernie55.lm_head", 55, 10)
    t.launch(56, [("gemm_a", 57, 6)])
    t.range("ernie55.sampling", 70, 10)
    t.launch(71, [("argmax_k", 72, 2)])
    t.launch(85, [("copy_k", 86, 1)])
    return t.json()


def test_eager_kernels_take_their_innermost_range():
    summary, items = bs.breakdown(eager_trace())
    c = summary["components"]
    want = {"embed": 2, "hca": 15, "attn_meta": 1, "moe.route": 3, "moe.experts": 8, "lm_head": 6}
    want.update({"sampling": 2, "other": 2})
    for key, us in want.items():
        assert c[key] == pytest.approx(us / 1e3), key
    assert set(c) == set(bs.COMPONENT_KEYS) and c["mhc"] == 0.0
    assert summary["span_ms"] == pytest.approx((87 - 10) / 1e3)  # first kernel start to last kernel end
    assert summary["busy_ms"] == pytest.approx(sum(want.values()) / 1e3)  # no overlaps here
    assert summary["gaps_ms"] == pytest.approx(summary["span_ms"] - summary["busy_ms"])
    assert [w.name for w in items][:3] == ["embed_k", "gemm_a", "meta_k"]


def test_idle_stretches_go_to_the_range_that_ended_them():
    """Device idle inside the span: a stretch the host caused (the next kernel launched after the device went
    idle) and one where the kernel was launched early but started late, each under the range of the kernel
    that ended it; stretches under IDLE_MIN_US are left out of the rows but counted in gaps_ms."""
    t = Trace()
    t.range(bs.STEP_RANGE, 0, 1000)
    t.range("ernie55.hca", 1, 400)
    t.launch(2, [("a_k", 10, 50)])  # busy 10..60
    t.launch(3, [("b_k", 65, 20)])  # 5 us gap: a launch's latency, not a stretch
    t.range("ernie55.mhc", 100, 200)
    t.launch(200, [("c_k", 205, 10)])  # idle 85..205: launched at 200, after the device went idle
    t.launch(210, [("d_k", 300, 10)])  # idle 215..300: launched at 210, before
    t.range("ernie55.moe.experts", 400, 100)
    t.launch(450, [("e_k", 460, 40)])  # idle 310..460, host late
    summary, _ = bs.breakdown(t.json())
    idle = summary["idle_by_range"]
    assert list(idle) == ["mhc", "moe.experts"]  # largest total first
    assert idle["mhc"] == pytest.approx({"host_late_ms": 0.12, "launched_before_ms": 0.085, "stretches": 2})
    assert idle["moe.experts"] == pytest.approx(
        {"host_late_ms": 0.15, "launched_before_ms": 0.0, "stretches": 1}
    )
    assert [(g["next"], g["host_late"]) for g in summary["idle_largest"]] == [
        ("e_k", True),
        ("c_k", True),
        ("d_k", False),
    ]
    stretches = sum(v["host_late_ms"] + v["launched_before_ms"] for v in idle.values())
    assert summary["gaps_ms"] == pytest.approx(stretches + 0.005)


def test_eager_kernel_without_its_launch_takes_its_host_op():
    t = Trace()
    t.range(bs.STEP_RANGE, 0, 100)
    t.range("ernie55.lm_head", 10, 20)
    t.events.append(
        dict(ph="X", cat="cpu_op", name="aten::mul", pid=10, tid=11, ts=12, dur=3, args={"External id": 5})
    )
    t.events.append(
        dict(ph="X", cat="kernel", name="mul_k", pid=0, tid=7, ts=40, dur=2, args={"External id": 5})
    )
    t.launch(50, [("copy_k", 51, 1)])
    summary, _ = bs.breakdown(t.json())
    assert (
        summary["components"]["lm_head"] == pytest.approx(0.002) and summary["components"]["other"] == 0.001
    )
    assert summary["graph_items_per_step"] == 0


def test_graph_replay_is_aligned_to_the_eager_step():
    _, reference = bs.breakdown(eager_trace())
    t = Trace()
    t.range(bs.STEP_RANGE, 0, 100)
    t.launch(1, [("h2d_copy", 2, 1)])  # outside the graph, outside every range
    # the graph: the eager step's model kernels, one missing (meta_k) and one the eager step never ran
    body = ["embed_k", "gemm_a", "flash_k", "topk_k", "fused_moe_k", "graph_only_k", "gemm_a"]
    kernels, start = [], 10
    for name in body:
        kernels.append((name, start, 2))
        start += 3
    t.launch(5, kernels, api="cudaGraphLaunch_v10000")
    t.range("ernie55.sampling", 60, 10)
    t.launch(61, [("argmax_k", 62, 2)])
    t.kernel("orphan_k", 70, 1, corr=999)  # its launch is not in the trace: placed at its own start
    summary, _ = bs.breakdown(t.json(), reference)
    c = summary["components"]
    assert c["embed"] == pytest.approx(0.002) and c["hca"] == pytest.approx(0.004)  # gemm_a, flash_k
    assert c["moe.route"] == pytest.approx(0.002) and c["moe.experts"] == pytest.approx(0.002)
    assert c["lm_head"] == pytest.approx(0.002) and c["sampling"] == pytest.approx(0.002)
    assert c["other"] == pytest.approx(0.004)  # h2d_copy, graph_only_k, orphan_k (1 + 2 + 1 us)
    assert summary["graph_items_per_step"] == 8  # the 7 graph kernels and the orphan
    assert summary["graph_match_fraction"] == pytest.approx(6 / 8)
    assert summary["span_ms"] == pytest.approx((71 - 2) / 1e3)


def test_host_trace_counts_top_level_ops_once():
    t = Trace()
    t.range(bs.STEP_RANGE, 0, 100)
    t.range("ernie55.mhc", 5, 30)
    t.op("aten::linear", 6, 20)
    t.op("aten::mm", 7, 18)  # inside aten::linear: not counted again
    t.op("aten::add", 28, 4)
    t.range("ernie55.lm_head", 40, 10)
    t.op("aten::mm", 41, 5)
    t.op("aten::copy_", 60, 10)  # outside the ranges
    summary, _ = bs.breakdown(t.json())
    c = summary["components"]
    assert c["mhc"] == pytest.approx(0.024) and c["lm_head"] == pytest.approx(0.005)
    assert c["other"] == pytest.approx(0.010)
    assert summary["span_ms"] == pytest.approx(0.1)  # the step range
    assert summary["gaps_ms"] == pytest.approx(0.1 - 0.039)


def test_components_map_dotted_range_names():
    assert bs.component_of("ernie55.mla_dsa") == "mla_dsa"
    assert bs.component_of("ernie55.hca.anything") == "hca"
    assert bs.component_of("ernie55.moe.latent") == "moe.latent"
    assert bs.component_of("ernie55.moe") == "other"  # the MoE's own range outside its parts
    assert bs.component_of("ernie55.moes") == "other" and bs.component_of(None) == "other"


def test_experts_hit():
    E, k = 512, 10
    assert bs.experts_hit(E, k, 1) == pytest.approx(k)
    assert bs.experts_hit(E, k, 64) == pytest.approx(E * (1 - (1 - k / E) ** 64))
    assert 400 < bs.experts_hit(E, k, 256) < E
    hits = [bs.experts_hit(E, k, b) for b in (1, 8, 64, 256, 4096)]
    assert hits == sorted(hits) and hits[-1] == pytest.approx(E, rel=1e-6)


def test_floor_counts_weights_and_gemm_flops():
    lin = torch.nn.Linear(64, 32, bias=False)
    f = bs.Floor()
    f.weights(lin, tokens=3)
    assert f.bytes == 64 * 32 * 4 and f.flops["fp32"] == 2 * 3 * 64 * 32
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.zeros(8, 6, 4, dtype=torch.bfloat16))
    experts.w13_weight_scale_inv = torch.nn.Parameter(torch.zeros(8, 1, 1))
    g = bs.Floor()
    g.weights(
        experts, tokens=5, fraction=0.5, per_token_frac=2 / 8
    )  # half the experts read, 2 of 8 per token
    assert g.bytes == pytest.approx(0.5 * (8 * 6 * 4 * 2 + 8 * 4))
    assert g.flops["bf16"] == pytest.approx(2 * 5 * 2 * 6 * 4) and g.flops["fp32"] == 0  # scales: no FLOPs
    d = g.to_dict(bw=1e9, rates={"bf16": 1e12, "fp32": 1e11, "fp8": 2e12})
    assert d["byte_ms"] == pytest.approx(g.bytes / 1e9 * 1e3) and d["flop_ms"] == pytest.approx(
        480 / 1e12 * 1e3
    )


def test_ranges_are_off_unless_asked():
    from sglang_ernie55 import profiling

    old = profiling.ENABLED
    try:
        profiling.ENABLED = False
        assert profiling.forward_range("mhc") is profiling.forward_range("norm")  # one shared no-op
        profiling.ENABLED = True
        assert isinstance(profiling.forward_range("mhc"), torch.profiler.record_function)
    finally:
        profiling.ENABLED = old
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ERNIE55_PROFILE_RANGES"}
    code = "from sglang_ernie55 import profiling; print(profiling.ENABLED)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


STORE_CHECK = """
import torch
from benchmarks import bench_step as bs
from sglang_ernie55.configuration import Ernie55Config
from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool
from tests.serving import twin_harness as th

th.init_dist()
cfg = Ernie55Config(num_hidden_layers=2, layer_types=["hca", "mla_dsa"], bos_token_id=1, eos_token_id=2)
for dt in (torch.float8_e4m3fn, torch.bfloat16):
    pools = [Ernie55TokenToKVPool(512, 256, dt, cfg, num_req_slots=2, device="cpu", swa_size=512) for _ in "ab"]
    for name in ("win", "cmp", "latent", "index_k"):
        for lid in getattr(pools[0], name):
            kernel, twin = (getattr(p, name)[lid] for p in pools)
            loc = torch.randperm(kernel.rows)[:6]
            x = torch.randn(len(loc), kernel.width)
            bs.store_rows(kernel, loc, x, kernel=True)
            bs.store_rows(twin, loc, x, kernel=False)
            assert torch.equal(kernel.pool, twin.pool), (dt, name)
            assert torch.isfinite(twin.read(loc)).all()
print("stores equal")
"""


@pytest.mark.slow
def test_pool_fill_kernel_writes_the_twins_bytes():
    """The CUDA fill's store-kernel call (full-width fp8 and bf16 layouts, in Triton's interpreter) writes the
    bytes the pool's own codec writes."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", STORE_CHECK], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert "stores equal" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
def test_cpu_smoke(tmp_path):
    env = dict(os.environ, BENCH_STEP_WORK=str(tmp_path / "work"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "benchmarks/bench_step.py", "--cpu-smoke", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    res = json.loads((tmp_path / "out" / "bench_step.json").read_text())
    assert [(p["batch"], p["context"]) for p in res["points"]] == [(1, 200), (2, 200)], log
    assert res["meta"]["attention"] == {"hca": "torch", "mla_dsa": "torch"}
    md = (tmp_path / "out" / "bench_step.md").read_text()
    for p in res["points"]:
        e, t = p["eager"], p["timed"]
        assert p["graph"] is None and t["step_ms"] > 0 and t["steps"] == 2
        assert set(e["components"]) == set(bs.COMPONENT_KEYS)
        assert all(v >= 0 for v in e["components"].values()) and e["gaps_ms"] >= 0
        # each range the model opens (and the bench's sampling range) saw work
        for key in ("embed", "hca", "mla_dsa", "dense_ffn", "moe.route", "moe.latent", "moe.experts"):
            assert e["components"][key] > 0, (key, e["components"])
        for key in ("moe.shared", "mhc", "lm_head", "sampling", "attn_meta"):
            assert e["components"][key] > 0, (key, e["components"])
        work = sum(e["components"].values())
        # up to the trace's time resolution: its stamps are ~1.7e12 us, where a double resolves ~2.4e-4 us, so
        # each item's two ends may be off by that much
        res_ms = e["items_per_step"] * 5e-4 / 1e3
        assert work <= e["span_ms"] + res_ms, (work, e["span_ms"])
        assert work + e["gaps_ms"] == pytest.approx(e["span_ms"], abs=res_ms), e
        fl = p["floors"]
        for key in ("hca", "mla_dsa", "dense_ffn", "moe.experts", "moe.shared", "mhc", "lm_head"):
            assert fl[key]["bytes"] > 0 and fl[key]["byte_ms"] > 0 and sum(fl[key]["flops"].values()) > 0, key
    one, two = (p["floors"]["moe.experts"]["bytes"] for p in res["points"])
    assert two / one == pytest.approx(bs.experts_hit(16, 4, 2) / bs.experts_hit(16, 4, 1))  # tiny: 4 of 16
    for _, label, _ in bs.COMPONENTS:
        assert md.count(f"| {label} |") == len(res["points"]), label
    assert md.count("launch gaps") == 0 and md.count("gaps (host time between ops)") == len(res["points"])
