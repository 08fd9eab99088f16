"""Issue 13 diagnosis: where an odd-geometry checkpoint served with fp32 activations and bf16 KV leaves the
bf16-KV oracle on the GPU (the CPU server equals it; the H200 server scored 312-313/320 where the tiny preset
scores 415/416).

Run on the GPU machine from the repository root (`python3 -m tests.serving.geometry_diag`, ~1-3 minutes; `--device cpu` runs the
torch-only variants as a smoke test). It builds its own random checkpoints (in memory, the reference's weights
in bf16, as `make-tiny` writes them) and, per geometry, the SGLang model in-process on the GPU (the way
tests/serving/layer_impl_check.py builds it: `twin_harness`, fp32 activations, the pool at bf16 KV, the
`ernie55` backend on its torch path), then runs the same random token sequences through it (one chunked
prefill + 4 decode steps each) under several variants and compares every position with the reference model on
the host, whose stored KV tensors are rounded to bf16 as the pool stores them
(`server_harness.kv_rounded_reference`).

Variants (name = layer compute / experts):
- layer compute (SGLANG_ERNIE55_LAYER_IMPL) `triton` | `torch`: mHC, routing, norms, RoPE on the project's
  Triton kernels (the CUDA default) or the torch math;
- experts `fused`: SGLang's FusedMoE as the server runs it (Triton `fused_moe_kernel`; at fp32 activations its
  dots take tf32 operands unless TRITON_F32_DEFAULT says otherwise, and its `compute_type` rounds both GEMM
  outputs to fp16); `f32out`: the same kernel with its output rounding in fp32 (compute_type patched); `twin`:
  the experts in fp32 torch (cuBLAS IEEE; `twin_harness.static_experts`), i.e. no FusedMoE;
- `.../ieee`: run again in a second process with TRITON_F32_DEFAULT=ieee (tl.dot's default input precision; a
  tl.dot probe in each process reports the precision it really got: `tl_dot_fp32_default`);
- `.../graph`: the DECODE steps replayed from a captured decode CUDA graph (the geometry-matrix servers run
  with decode graphs on; at these geometries the attention is the backend's torch twin, whose graph path no
  earlier GPU run scored) vs the same steps eager: `graph_vs_eager_max_logit` must be rounding-level (~1e-5);
- `host:emulated tf32trunc+fp16` / `host:emulated fp16`: no GPU; the oracle against itself with its experts
  rounded as FusedMoE rounds them (tf32-truncated operands and fp16 GEMM outputs; fp16 outputs only): the
  floor an otherwise exact server with SGLang's fp32 FusedMoE sits at.
Geometries: `tiny` (the preset: its only MLA-DSA layer precedes every MoE layer), `user` (tests/serving/
geometries.py `odd_mla_dims`: MLA-DSA at layers 0 and 2, so layer 1's MoE output feeds a DSA top-k) and
`mla_first` (`w128_c32_r3_mla_first`: its only MLA-DSA layer is layer 0, 3 routers, 7 of 8 experts).

Per variant: top-1 agreement with the oracle over every position, `flips` (disagreements where the oracle's
top-1 beats the model's choice by > 0.01 nats), max |logit error|, mean |logprob error| of the oracle's top-1,
positions whose routed expert set differs from the oracle's per MoE layer, and, per layer, positions whose
residual streams leave the oracle's by > 1e-2 relative (the layer where a discrete choice flipped: a DSA top-k
in an MLA-DSA layer, a routing top-k in a MoE layer; continuous noise stays ~1e-6 .. 1e-3). Each flip is
attributed to the first such layer, with the oracle's own margin of that layer's discrete choice at that
position. A FusedMoE micro-check per geometry compares the experts alone (random latents, the model's routes)
with the fp32 twin and with a torch emulation of tf32 operands + fp16 outputs: if `fused` sits on the
emulation and far from the twin, the deviation is that rounding (no masking bug at moe_intermediate_size 80).

Output: the environment facts, one table row per (geometry, variant), the flips, a SUMMARY line per geometry
(flips per variant), and one line `GEOMETRY_DIAG_JSON {...}` with everything. Reading it: `torch/twin` and
`triton/twin` at ~0 flips and `triton/fused` near the `host:emulated tf32trunc+fp16` floor = FusedMoE's fp32
rounding amplified by the DSA / routing choices explains the servers (and `triton/f32out/ieee` near 0 flips is
the fix); `torch/twin` with flips = the GPU torch path; `triton/twin` worse than `torch/twin` = the layer
kernels; `triton/fused` far below the floor, or `experts_check` far from every emulation = FusedMoE itself at
this shape; a large `graph_vs_eager_max_logit` = the decode graph path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

JSON_TAG = "GEOMETRY_DIAG_JSON"
WORKER_TAG = "GEOMETRY_DIAG_WORKER"
FLIP_NATS = 0.01
BIG_ERR = 1e-2
LENGTHS = (19, 150, 300, 510)  # 510: the decode steps complete a compressed block (positions 511 .. 513)
DECODE = 4
DEFAULT_VARIANTS = "triton/fused,triton/f32out,triton/twin,torch/twin,triton/fused/graph"
IEEE_VARIANTS = "triton/fused,triton/f32out"

# Copies of tests/serving/geometries.py rows (this script must not depend on a file that may change).
GEOMETRIES = {
    "tiny": {},
    "user": dict(
        num_hidden_layers=4,
        layer_types=["mla_dsa", "hca", "mla_dsa", "hca"],
        window_size=64,
        compress_ratio=32,
        num_routers=3,
        head_dim=96,
        qk_rope_head_dim=32,
        v_head_dim=48,
        qk_nope_head_dim=40,
        kv_lora_rank=96,
        index_head_dim=48,
        index_n_heads=4,
        moe_intermediate_size=80,
        n_routed_experts=12,
        num_experts_per_tok=3,
    ),
    "mla_first": dict(
        num_hidden_layers=3,
        layer_types=["mla_dsa", "hca", "hca"],
        first_k_dense_replace=0,
        window_size=128,
        compress_ratio=32,
        num_routers=3,
        n_routed_experts=8,
        num_experts_per_tok=7,
        moe_intermediate_size=72,
    ),
}


def geometry_config(name: str):
    from sglang_ernie55.configuration import tiny_config

    return tiny_config(**GEOMETRIES[name])


def sequences(cfg, seed: int = 0, lengths=LENGTHS) -> list[torch.Tensor]:
    """Random token sequences, BOS first: `lengths` prefill tokens + DECODE decode tokens each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, cfg.vocab_size, (n + DECODE,), generator=g)
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------------- oracle (host)
class _OracleSpy:
    """Records, during one reference forward, each layer's output streams and each discrete choice with the
    oracle's own margin (DSA: index_topk-th minus next causal indexer score; MoE: top_k-th minus next biased
    routing score), in call order."""

    def __init__(self, ref):
        from sglang_ernie55.reference import functional as Fn

        self.Fn, self.ref = Fn, ref
        self.streams: list[torch.Tensor] = []
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []

    def index(self, scores, q_pos, k_pos, topk):
        causal = k_pos[None, :] <= q_pos[:, None]
        v = torch.sort(scores.masked_fill(~causal, float("-inf")), -1, descending=True).values
        m = torch.full((scores.shape[0],), float("inf"))
        if v.shape[1] > topk:
            gap = (v[:, topk - 1] - v[:, topk]).double()
            m = torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf"))).float()
        self.calls.append(("dsa", m, None))
        return self._index(scores, q_pos, k_pos, topk)

    def route(self, x, routers, bias, topk, *a, **k):
        w, idx = self._route(x, routers, bias, topk, *a, **k)
        s = torch.stack([torch.sigmoid(x.float() @ r.float().t()) for r in routers]).mean(0) + bias.float()
        v = torch.sort(s, -1, descending=True).values
        m = v[:, topk - 1] - v[:, topk] if v.shape[1] > topk else torch.full((x.shape[0],), float("inf"))
        self.calls.append(("route", m.float(), idx))
        return w, idx

    def __enter__(self):
        Fn = self.Fn
        self._index, self._route = Fn.indexer_topk, Fn.multi_router_topk
        Fn.indexer_topk, Fn.multi_router_topk = self.index, self.route
        self.hooks = [
            layer.register_forward_hook(lambda _m, _i, o: self.streams.append(o.float().clone()))
            for layer in self.ref.model.layers
        ]
        return self

    def __exit__(self, *exc):
        self.Fn.indexer_topk, self.Fn.multi_router_topk = self._index, self._route
        for h in self.hooks:
            h.remove()
        return False


@torch.no_grad()
def oracle(cfg, ref, seqs) -> list[dict]:
    """Per sequence, from the reference with its stored KV rounded to bf16: fp32 logits [L, V], the streams
    after each layer [L, n, H], the routed expert ids per MoE layer (sorted), per layer the margin of its
    discrete choices (`_OracleSpy`; inf where nothing is chosen)."""
    from tests.serving import server_harness as sh

    out = []
    for ids in seqs:
        L = len(ids)
        with _OracleSpy(ref) as spy, sh.kv_rounded_reference("bfloat16"):
            logits = ref.forward(ids).logits.float()
        rec = {"logits": logits, "streams": spy.streams, "margin": [], "routes": {}}
        it = iter(spy.calls)
        for li, kind in enumerate(cfg.layer_types):
            m = torch.full((L,), float("inf"))
            if kind == "mla_dsa":
                m = torch.minimum(m, next(it)[1])
            if cfg.is_moe_layer(li):
                _, rm, idx = next(it)
                m = torch.minimum(m, rm)
                rec["routes"][li] = torch.sort(idx.long(), -1).values
            rec["margin"].append(m)
        out.append(rec)
    return out


def emulated_moe_forward(tf: str | None, fp16: bool):
    """reference LatentMoE.forward with the experts rounded as SGLang's fp32-activation FusedMoE rounds them
    on the GPU: tf32 operands (`tf` "trunc": the low 13 mantissa bits dropped; "rne": rounded; None: fp32) and
    both GEMM outputs rounded to fp16 (`compute_type`; the routed weight is applied before the second
    rounding)."""
    import torch.nn.functional as F

    from sglang_ernie55.reference.model import lin

    def r(x):
        return x if tf is None else _tf32(x, tf == "rne")

    def fwd(self, x):
        w, idx = self.route(x)
        z = lin(x, self.latent_down)
        acc = torch.zeros_like(z)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            ex = self.experts[e]
            zz = r(z[tok])
            g, u = zz @ r(ex.gate_proj.weight.float()).t(), zz @ r(ex.up_proj.weight.float()).t()
            if fp16:
                g, u = g.half().float(), u.half().float()
            o = (r(F.silu(g) * u) @ r(ex.down_proj.weight.float()).t()) * w[tok, slot, None]
            acc.index_add_(0, tok, o.half().float() if fp16 else o)
        y = lin(acc, self.latent_up)
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    return fwd


@torch.no_grad()
def emulated_oracle(cfg, ref, seqs, tf: str | None, fp16: bool) -> list[dict]:
    """`oracle` with the reference's experts rounded as FusedMoE rounds them (`emulated_moe_forward`): the
    agreement an exact server with SGLang's fp32 FusedMoE can reach against the oracle (its noise floor)."""
    from sglang_ernie55.reference import model as M

    orig = M.LatentMoE.forward
    M.LatentMoE.forward = emulated_moe_forward(tf, fp16)
    try:
        return oracle(cfg, ref, seqs)
    finally:
        M.LatentMoE.forward = orig


# --------------------------------------------------------------------------------------------- model (device)
def build_model(cfg, ref, device: str):
    from tests.serving import twin_harness as th

    th.init_dist()
    model = th.build_model(cfg, dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    model = model.to(device)
    model.prepare_after_load()
    # What SGLang's loader does after load_weights (FusedMoE at fp32: nothing on CUDA). Not on the CPU: with
    # AMX it would repack the expert weights for SGLang's CPU kernels, which the twin cannot read.
    if device == "cuda":
        for mod in model.modules():
            qm = getattr(mod, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(mod)
    return model


class Experts:
    """Switches every latent MoE's experts between SGLang's FusedMoE (`fused`), the same with fp32 output
    rounding (`f32out`) and an fp32 torch twin (`twin`)."""

    def __init__(self, model):
        from sglang_ernie55.layers.moe import Ernie55LatentMoE
        from tests.serving import twin_harness as th

        self.mods = [m.experts for m in model.modules() if isinstance(m, Ernie55LatentMoE)]
        # static_experts sets `.forward` on each FusedMoE; keep those closures, then take them off again
        th.static_experts(model)
        self.twin = {id(ex): ex.__dict__.pop("forward") for ex in self.mods}
        self._orig_invoke = None

    def set(self, mode: str) -> None:
        for ex in self.mods:
            ex.__dict__.pop("forward", None)
            if mode == "twin":
                ex.forward = self.twin[id(ex)]
        self._f32out(mode == "f32out")

    def _f32out(self, on: bool) -> None:
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe as fm

        if self._orig_invoke is None:
            self._orig_invoke = fm.invoke_fused_moe_kernel
        if not on:
            fm.invoke_fused_moe_kernel = self._orig_invoke
            return
        import triton.language as tl

        orig = self._orig_invoke

        def invoke(A, *a, **k):
            if A.dtype == torch.float32 and k.get("compute_type") is not None:
                k["compute_type"] = tl.float32
            return orig(A, *a, **k)

        fm.invoke_fused_moe_kernel = invoke


class _ModelSpy:
    """Records, during the SGLang model's forwards, each layer's output streams and each MoE layer's routed
    ids."""

    def __init__(self, model):
        from sglang_ernie55.layers.moe import Ernie55LatentMoE

        self.layers = model.model.layers
        self.moes = {li: m.mlp for li, m in enumerate(self.layers) if isinstance(m.mlp, Ernie55LatentMoE)}
        self.streams: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.routes: dict[int, list[torch.Tensor]] = {li: [] for li in self.moes}

    def _hook(self, li: int):
        # the model's loop gets (R', the next site's mix) from each layer
        return lambda _m, _i, o: self.streams[li].append((o[0] if isinstance(o, tuple) else o).float().cpu())

    def _route(self, li: int, orig):
        def route(x):
            w, i, extra = orig(x)
            self.routes[li].append(torch.sort(i.long(), -1).values.cpu())
            return w, i, extra

        return route

    def __enter__(self):
        self.hooks = [layer.register_forward_hook(self._hook(li)) for li, layer in enumerate(self.layers)]
        for li, moe in self.moes.items():
            moe.route = self._route(li, moe.route)
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for moe in self.moes.values():
            moe.__dict__.pop("route", None)
        return False


@torch.no_grad()
def run_variant(model, cfg, seqs, device: str) -> list[dict]:
    """Per sequence (a fresh pool at bf16 KV, attention on the backend's torch path): one prefill of all but
    the last DECODE tokens, then DECODE decode steps. Returns the logits [L, V], the streams per layer and the
    routed ids per MoE layer (sorted), on the host."""
    from tests.serving import twin_harness as th

    res = []
    for ids in seqs:
        with _ModelSpy(model) as spy:
            s = th.Session(
                model, cfg, torch.bfloat16, num_pages=8, max_ctx=1024, slots=2, impl="torch", device=device
            )
            parts = [s.extend([0], [ids[:-DECODE]])] + [s.decode([0], [int(t)]) for t in ids[-DECODE:]]
        res.append(
            {
                "logits": torch.cat(parts).float().cpu(),
                "streams": [torch.cat(x) for x in spy.streams],
                "routes": {li: torch.cat(x) for li, x in spy.routes.items()},
            }
        )
    return res


class _GraphDecode:
    """Decode steps of one request (slot 0, batch 1) as SGLang's decode CUDA graph runs them: the backend's
    out-of-graph metadata (the twin's static context-wide width), then the model forward and the LM head
    captured once on static buffers and replayed per step with the step's token, position, slot and length
    copied in. On the CPU (no graphs) the captured body runs directly on the same static buffers."""

    def __init__(self, session, model, device: str):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.s, self.model, self.device = session, model, device
        z = lambda: torch.zeros(1, dtype=torch.int64, device=device)  # noqa: E731
        self.ids, self.pos, self.loc, self.seq, self.req = z(), z(), z(), z(), z()
        self.fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            out_cache_loc=self.loc,
            req_pool_indices=self.req,
            seq_lens=self.seq,
            seq_lens_cpu=None,
            extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None,
            global_num_token_non_padded_cpu=None,
            batch_size=1,
        )
        self.graph = self.out = None

    def _body(self) -> torch.Tensor:
        from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context

        be = self.s.backend
        be.init_forward_metadata_in_graph(self.fb)
        prev = set_forward_context(ForwardContext(attn_backend=be))
        try:
            hidden, _ = self.model.model(self.ids, self.pos, self.fb)
        finally:
            set_forward_context(prev)
        return hidden.float() @ self.model.lm_head.weight.float().t()

    def step(self, token: int) -> torch.Tensor:
        s = self.s
        P = s.lens[0]
        loc = s.alloc_tokens(0, 1, decode=True)
        s.lens[0] = P + 1
        for buf, v in ((self.ids, token), (self.pos, P), (self.seq, P + 1)):
            buf.fill_(v)
        self.loc.copy_(loc.view(1))
        if self.graph is None and self.out is None:
            be = s.backend
            be.init_cuda_graph_state(1, 1)
            be.init_forward_metadata_out_graph(self.fb, in_capture=True)
            if self.device != "cuda":
                self.out = "eager"
            else:  # warm-up on a side stream (its writes are this step's, which the first replay repeats)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._body()
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.out = self._body()
        if self.graph is None:
            return self._body().float().cpu()
        self.graph.replay()
        return self.out.float().cpu()


@torch.no_grad()
def run_graph_variant(model, cfg, seqs, device: str) -> list[dict]:
    """Per sequence: the same prefill, then the last DECODE tokens decoded eagerly (one session) and through a
    captured decode graph (a second session from the same start). Logits of the decoded positions, host."""
    from tests.serving import twin_harness as th

    res = []
    for ids in seqs:
        out = {}
        for mode in ("eager", "graph"):
            s = th.Session(
                model, cfg, torch.bfloat16, num_pages=8, max_ctx=1024, slots=2, impl="torch", device=device
            )
            s.extend([0], [ids[:-DECODE]])
            if mode == "eager":
                out[mode] = torch.cat([s.decode([0], [int(t)]) for t in ids[-DECODE:]]).float().cpu()
            else:
                g = _GraphDecode(s, model, device)
                out[mode] = torch.cat([g.step(int(t)) for t in ids[-DECODE:]])
        res.append(out)
    return res


def score_graph(orc: list[dict], got: list[dict]) -> dict:
    """Decode positions only: graph vs eager logits, and each against the oracle (top-1, flips)."""
    rep = {
        "positions": 0,
        "graph_vs_eager_max_logit": 0.0,
        "top1_graph": 0,
        "top1_eager": 0,
        "flips_graph": 0,
    }
    for o, g in zip(orc, got):
        b = o["logits"][-DECODE:]
        lpb = torch.log_softmax(b, -1)
        rep["positions"] += DECODE
        rep["graph_vs_eager_max_logit"] = max(
            rep["graph_vs_eager_max_logit"], float((g["graph"] - g["eager"]).abs().max())
        )
        for name in ("graph", "eager"):
            top = g[name].argmax(-1)
            rep[f"top1_{name}"] += int((top == b.argmax(-1)).sum())
            if name == "graph":
                gap = lpb.max(-1).values - lpb.gather(1, top[:, None])[:, 0]
                rep["flips_graph"] += int((gap > FLIP_NATS).sum())
    return rep


def _finite(x) -> float | None:
    x = float(x)
    return x if abs(x) != float("inf") else None


def score(cfg, orc: list[dict], got: list[dict]) -> dict:
    n = agree = flips = 0
    max_logit = 0.0
    lp_err = []
    route_diff = {li: 0 for li in orc[0]["routes"]}
    big = [0] * cfg.num_hidden_layers
    flip_list = []
    for s, (o, g) in enumerate(zip(orc, got)):
        a, b = g["logits"], o["logits"]
        lpb = torch.log_softmax(b, -1)
        lpa = torch.log_softmax(a, -1)
        top_o, top_g = b.argmax(-1), a.argmax(-1)
        gap = lpb.max(-1).values - lpb.gather(1, top_g[:, None])[:, 0]
        n += len(a)
        agree += int((top_o == top_g).sum())
        max_logit = max(max_logit, float((a - b).abs().max()))
        lp_err.append((lpa - lpb).gather(1, top_o[:, None])[:, 0].abs())
        for li in route_diff:
            route_diff[li] += int((g["routes"][li] != o["routes"][li]).any(-1).sum())
        errs = []
        for li in range(cfg.num_hidden_layers):
            ro, rg = o["streams"][li], g["streams"][li]
            e = (rg - ro).flatten(1).abs().amax(-1) / ro.flatten(1).abs().amax(-1).clamp_min(1e-30)
            errs.append(e)
            big[li] += int((e > BIG_ERR).sum())
        errs = torch.stack(errs, 1)  # [L, layers]
        for p in ((top_o != top_g) & (gap > FLIP_NATS)).nonzero()[:, 0].tolist():
            flips += 1
            hit = (errs[p] > BIG_ERR).nonzero()
            first = int(hit[0]) if len(hit) else None
            flip_list.append(
                {
                    "seq": s,
                    "pos": p,
                    "gap_nats": round(float(gap[p]), 4),
                    "first_big_layer": first,
                    "first_kind": None
                    if first is None
                    else cfg.layer_types[first] + ("+moe" if cfg.is_moe_layer(first) else "+dense"),
                    "oracle_margin_there": _finite(o["margin"][first][p]) if first is not None else None,
                    "layer_rel_err": [float(f"{x:.2e}") for x in errs[p].tolist()],
                }
            )
    return {
        "top1": agree,
        "positions": n,
        "flips": flips,
        "max_logit_err": max_logit,
        "mean_lp_err": float(torch.cat(lp_err).mean()),
        "route_diff": route_diff,
        "big_err_positions": big,
        "flip_list": flip_list,
    }


# ---------------------------------------------------------------------------------------------- experts alone
def _tf32(x: torch.Tensor, rne: bool) -> torch.Tensor:
    i = x.float().contiguous().view(torch.int32)
    if rne:
        i = i + 0xFFF + ((i >> 13) & 1)
    return (i & ~0x1FFF).view(torch.float32)


@torch.no_grad()
def experts_check(model, cfg, ex: Experts, device: str) -> dict:
    """FusedMoE alone at this geometry: random latents, the model's own routes, vs the fp32 twin and vs a
    torch emulation of tf32 operands (truncated / rounded) with fp16 GEMM outputs."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from sglang_ernie55.layers.moe import Ernie55LatentMoE

    moe = next(m for m in model.modules() if isinstance(m, Ernie55LatentMoE))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(257, cfg.hidden_size, generator=g).to(device)
    w, ids, logits = moe.route(x)
    z = moe.latent_down(x)[0]
    topk = StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=logits)
    fx = moe.experts
    w13, w2 = fx.w13_weight.float(), fx.w2_weight.float()
    inter = w2.shape[-1]

    def emulate(tf: str | None, fp16: bool) -> torch.Tensor:
        out = torch.zeros(z.shape[0], w2.shape[1], device=device)
        for k in range(ids.shape[1]):
            e = ids[:, k].long()
            zz = z.float() if tf is None else _tf32(z, tf == "rne")
            a, b = w13[e], w2[e]
            if tf is not None:
                a, b = _tf32(a, tf == "rne"), _tf32(b, tf == "rne")
            gu = torch.einsum("tl,til->ti", zz, a)
            if fp16:
                gu = gu.half().float()
            h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            if tf is not None:
                h = _tf32(h, tf == "rne")
            o = torch.einsum("ti,tli->tl", h, b) * w[:, k, None]
            out += o.half().float() if fp16 else o
        return out

    def rel(a, b) -> float:
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())

    rep: dict = {"intermediate": inter, "latent": int(z.shape[1]), "topk": int(ids.shape[1])}
    ex.set("twin")
    twin = fx(z, topk).float()
    refs = {
        "twin": twin,
        "tf32trunc_fp16": emulate("trunc", True),
        "tf32rne_fp16": emulate("rne", True),
        "fp16_only": emulate(None, True),
        "tf32trunc_only": emulate("trunc", False),
    }
    for mode in ("fused", "f32out"):
        try:
            ex.set(mode)
            got = fx(z, topk).float()
            rep[mode] = {name: rel(got, r) for name, r in refs.items()}
        except Exception as e:  # noqa: BLE001
            rep[mode] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
    ex.set("fused")
    return rep


# ---------------------------------------------------------------------------------------------- environment
def env_facts(device: str) -> dict:
    import triton

    f = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
    }
    try:
        f["cuda_matmul_fp32_precision"] = str(torch.backends.cuda.matmul.fp32_precision)
    except Exception:  # noqa: BLE001
        pass
    try:
        import sglang

        f["sglang"] = sglang.__version__
    except Exception as e:  # noqa: BLE001
        f["sglang"] = f"import failed: {e}"
    try:  # what a server of this geometry at --dtype float32 resolves (SGLang sets TF32 matmuls only if true)
        from sglang_ernie55.args import resolve_server_args

        with tempfile.TemporaryDirectory() as d:
            Path(d, "config.json").write_text(json.dumps(geometry_config("user").to_config_json()))
            argv = ["--model-path", d, "--dtype", "float32", "--kv-cache-dtype", "bfloat16"]
            rd = resolve_server_args(argv, device=device).resolved_dict()
        f["server_enable_tf32_matmul"] = rd.get("enable_tf32_matmul")
    except Exception as e:  # noqa: BLE001
        f["server_enable_tf32_matmul"] = f"resolution failed: {type(e).__name__}: {e}"
    if device == "cuda":
        try:
            f["tl_dot_fp32_default"] = dot_probe()
        except Exception as e:  # noqa: BLE001
            f["tl_dot_fp32_default"] = f"probe failed: {type(e).__name__}: {e}"
    return f


@triton.jit
def _dot_probe_kernel(a_ptr, b_ptr, c_ptr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b))


def dot_probe() -> str:
    """What tl.dot does with fp32 operands in this process: 1 + 2^-12 survives IEEE fp32 and is lost in
    tf32."""
    a = torch.eye(16, device="cuda") * (1 + 2**-12)
    b = torch.eye(16, device="cuda")
    c = torch.empty_like(a)
    _dot_probe_kernel[(1,)](a, b, c)
    v = float(c[0, 0])
    return "ieee" if v == 1 + 2**-12 else ("tf32" if v == 1.0 else f"other ({v!r})")


def fused_config(cfg) -> dict:
    """The Triton config FusedMoE picks for this geometry's shapes at 1 and 520 tokens (no tuned file exists
    for these shapes, so these are SGLang's defaults)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fc

    E, L, inter, k = (
        cfg.n_routed_experts,
        cfg.moe_latent_size,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
    )
    dtype = fc.get_config_dtype_str(torch.float32)
    out = {"config_dtype": dtype}
    for M in (1, 520):
        c, (d, _) = fc.try_get_optimal_moe_config(
            (E, 2 * inter, L), (E, L, inter), k, dtype, M, return_down_config=True
        )
        out[M] = {"up": dict(c), "down": dict(d) if d else None}
    return out


# ---------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    from sglang_ernie55.reference.model import build_reference

    dev = args.device
    out: dict = {"env": env_facts(dev), "geometries": {}}
    ieee = os.environ.get("TRITON_F32_DEFAULT") == "ieee"
    for gname in args.geometries.split(","):
        t0 = time.time()
        grep: dict = {"variants": {}, "graphs": {}}
        out["geometries"][gname] = grep
        os.environ.pop(
            "SGLANG_ERNIE55_LAYER_IMPL", None
        )  # `auto` at load: the router matrix is built before any capture
        try:
            cfg = geometry_config(gname)
            ref = build_reference(cfg, seed=args.seed)  # bf16 weights: what make-tiny writes
            seqs = sequences(cfg, args.seed, tuple(int(n) for n in args.lengths.split(",")))
            ref = ref.float().eval()
            orc = oracle(cfg, ref, seqs)
            model = build_model(cfg, ref, dev)
            ex = Experts(model)
        except Exception as e:  # noqa: BLE001
            grep["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        if not ieee:  # the host floors: the oracle against itself with FusedMoE's rounding emulated
            for name, tf, fp16 in (("tf32trunc+fp16", "trunc", True), ("fp16", None, True)):
                try:
                    t = time.time()
                    grep["variants"][f"host:emulated {name}"] = score(
                        cfg, orc, emulated_oracle(cfg, ref, seqs, tf, fp16)
                    )
                    grep["variants"][f"host:emulated {name}"]["s"] = round(time.time() - t, 1)
                except Exception as e:  # noqa: BLE001
                    grep["variants"][f"host:emulated {name}"] = {"error": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
        if dev == "cuda":
            for name, fn, fargs in (
                ("fused_config", fused_config, (cfg,)),
                ("experts_check", experts_check, (model, cfg, ex, dev)),
            ):
                try:
                    grep[name] = fn(*fargs)
                except Exception as e:  # noqa: BLE001
                    grep[name] = {"error": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
        for variant in args.variants.split(","):
            impl, mode, *graph = variant.split("/")
            name = variant + ("/ieee" if ieee else "")
            try:
                os.environ["SGLANG_ERNIE55_LAYER_IMPL"] = impl
                ex.set(mode)
                t = time.time()
                if graph:
                    grep["graphs"][name] = score_graph(orc, run_graph_variant(model, cfg, seqs, dev))
                    grep["graphs"][name]["s"] = round(time.time() - t, 1)
                    continue
                grep["variants"][name] = score(cfg, orc, run_variant(model, cfg, seqs, dev))
                grep["variants"][name]["s"] = round(time.time() - t, 1)
            except Exception as e:  # noqa: BLE001
                grep["graphs" if graph else "variants"][name] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
            finally:
                ex.set("fused")
        grep["s"] = round(time.time() - t0, 1)
        print(f"{gname} done in {grep['s']} s", flush=True)
    print(f"{WORKER_TAG} {json.dumps(out)}", flush=True)


# ---------------------------------------------------------------------------------------------- driver
def _spawn(args, extra_env: dict, variants: str, cache: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, **extra_env)
    for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SGLANG_ERNIE55_LAYER_IMPL"):
        env.pop(k, None)
    env["SGLANG_ERNIE55_ATTN_IMPL"] = "torch"
    cmd = [
        sys.executable,
        "-m",
        "tests.serving.geometry_diag",
        "--worker",
        "--device",
        args.device,
        "--geometries",
        args.geometries,
        "--variants",
        variants,
        "--seed",
        str(args.seed),
        "--lengths",
        args.lengths,
    ]
    root = Path(__file__).resolve().parents[2]  # a module of the tests package: run from the repository root
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root
    )


def _collect(name: str, p: subprocess.Popen, timeout: float) -> dict:
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        text, _ = p.communicate()
        text += f"\n[{name}] killed after {timeout:.0f} s"
    data = {}
    for line in text.splitlines():
        if line.startswith(WORKER_TAG + " "):
            data = json.loads(line[len(WORKER_TAG) + 1 :])
        else:
            print(f"[{name}] {line}")
    if not data:
        data = {"error": f"worker {name} printed no result (exit {p.returncode})"}
    return data


def _fmt(v) -> str:
    if "error" in v:
        return f"ERROR {v['error'][:150]}"
    rd = ",".join(f"L{k}:{x}" for k, x in v["route_diff"].items())
    big = ",".join(str(x) for x in v["big_err_positions"])
    return (
        f"top1 {v['top1']}/{v['positions']} flips {v['flips']:3d}  max|dlogit| {v['max_logit_err']:.2e}  "
        f"mean|dlp| {v['mean_lp_err']:.2e}  route_diff {rd or '-'}  big_err/layer {big}  ({v['s']} s)"
    )


def driver(args) -> None:
    t0 = time.time()
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        procs = {
            "default": _spawn(args, {}, args.variants if cuda else "torch/twin,torch/twin/graph", f"{tmp}/c0")
        }
        if cuda and args.ieee_variants:
            procs["ieee"] = _spawn(args, {"TRITON_F32_DEFAULT": "ieee"}, args.ieee_variants, f"{tmp}/c1")
        res = {k: _collect(k, p, args.timeout) for k, p in procs.items()}
    print("\n==== environment (per worker process)")
    for k, r in res.items():
        print(f"{k:8s} {json.dumps(r.get('env', r.get('error')))}")
    print(
        "\n==== per geometry and variant (layer compute / experts [/ieee]); streams 1e-6..1e-3 off = rounding"
    )
    for gname in args.geometries.split(","):
        print(f"-- {gname}: {GEOMETRIES[gname] or 'the tiny preset'}")
        for k, r in res.items():
            g = r.get("geometries", {}).get(gname, {})
            if "error" in g or "error" in r:
                print(f"   [{k}] ERROR {g.get('error', r.get('error'))}")
            for name, v in g.get("variants", {}).items():
                print(f"   {name:22s} {_fmt(v)}")
            for name, v in g.get("graphs", {}).items():
                print(f"   {name:22s} decode graph: {json.dumps(v)}")
            if "experts_check" in g:
                print(f"   [{k}] FusedMoE alone, max rel err vs: {json.dumps(g['experts_check'])}")
            if k == "default" and "fused_config" in g:
                print(f"   FusedMoE config: {json.dumps(g['fused_config'])}")
        flips = {}
        for r in res.values():
            for name, v in r.get("geometries", {}).get(gname, {}).get("variants", {}).items():
                flips[name] = v.get("flips", "error")
                for f in v.get("flip_list", [])[:6]:
                    print(f"   flip [{name}] {json.dumps(f)}")
            for name, v in r.get("geometries", {}).get(gname, {}).get("graphs", {}).items():
                flips[name] = v.get("flips_graph", "error")
        print(f"   SUMMARY {gname}: flips (> {FLIP_NATS} nats) per variant: {json.dumps(flips)}")
    print(f"\n{JSON_TAG} {json.dumps({'s': round(time.time() - t0, 1), 'workers': res})}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--geometries", default="tiny,user,mla_first")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="layer compute / experts, comma-separated")
    ap.add_argument("--ieee-variants", default=IEEE_VARIANTS, help="run again with TRITON_F32_DEFAULT=ieee")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prefill lengths of the sequences")
    ap.add_argument("--timeout", type=float, default=480.0, help="per worker process, seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
