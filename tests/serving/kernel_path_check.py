"""The `ernie55` backend's kernel path against its torch twin on the same pool, inside the backend.

Run from the repository root (`python -m tests.serving.kernel_path_check {backend,model} KV [DEVICE [GEOMETRY [IMPLS]]]`, prints one
JSON line; the CPU tests run it with TRITON_INTERPRET=1 in a subprocess) or import `run_backend` /
`run_model` (the GPU tests).

backend: one HCA and one MLA-DSA layer (or the one kind a geometry has), a sequence of batches the way SGLang's scheduler makes them
(fresh prefill, a mixed extend whose chunk completes a block from open-block state rows, a prefix hit of
a whole page into a slot with stale state, batched decode crossing a block boundary, a CUDA-graph-style
decode with a padded row and context-length widths). Before each compared batch the pool is snapshot;
every implementation runs the batch from that snapshot with the same fresh random inputs (queries and
indexer queries rounded to bf16, what the kernels read) and its outputs and pool are compared with the
twin's: attention outputs to a tolerance per dtype and device, window / latent / indexer rows and the
open-block state byte for byte, compressed entries by value (each compute rounds its own fp32 entry).
Batches between compared ones run on the twin only (the interpreter is slow).

model: the tiny SGLang model end to end (layers -> backend inputs -> kernels) on the kernel path vs the
twin (bf16 KV pool), logits of a chunked prefill crossing the block boundary and decode steps.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

from sglang_ernie55.configuration import SERVING_PAGE_SIZE
from tests.serving import twin_harness as th
from tests.shim_lib.triton_interpreter import install as _fast_interpreter

PAGE = SERVING_PAGE_SIZE


# attention layer kinds of the geometry-matrix rows this check runs (tests/serving/geometries.py): the row's
# window / ratio / widths with one layer of each kind it has, in the row's order
MATRIX_LAYERS = {"odd_mla_dims": ["mla_dsa", "hca"], "w32_c128_hca_only": ["hca"]}


def geometry_config(geometry: str):
    """One HCA layer (id 0) and one MLA-DSA layer (id 1) at the tiny or the full attention widths, or the
    attention geometry of a row of the geometry matrix (`MATRIX_LAYERS`)."""
    from sglang_ernie55.configuration import Ernie55Config, tiny_config

    if geometry == "tiny":
        return tiny_config(num_hidden_layers=2, layer_types=["hca", "mla_dsa"], first_k_dense_replace=2)
    if geometry == "full":
        return Ernie55Config(
            vocab_size=512,
            num_hidden_layers=2,
            layer_types=["hca", "mla_dsa"],
            first_k_dense_replace=2,
            intermediate_size=256,
            bos_token_id=1,
            eos_token_id=2,
        )
    if geometry in MATRIX_LAYERS:
        from tests.serving.geometries import BY_NAME

        kinds = MATRIX_LAYERS[geometry]
        over = dict(BY_NAME[geometry].overrides, num_hidden_layers=len(kinds), layer_types=kinds)
        return tiny_config(**dict(over, first_k_dense_replace=len(kinds)))
    raise ValueError(geometry)


class Slots:
    """req_to_token + a page allocator, as SGLang's paged allocator fills them (slot 0..255 = padding page)."""

    def __init__(self, num_pages: int, max_ctx: int, req_slots: int, device):
        self.req_to_token = torch.zeros(req_slots, max_ctx, dtype=torch.int32, device=device)
        self.free = list(range(1, num_pages + 1))
        g = torch.Generator().manual_seed(1)
        self.free = [self.free[i] for i in torch.randperm(len(self.free), generator=g)]  # shuffled pages
        self.lens = [0] * req_slots

    def alloc(self, req: int, n: int) -> torch.Tensor:
        locs = []
        for p in range(self.lens[req], self.lens[req] + n):
            if p % PAGE == 0:
                pg = self.free.pop(0)
                self.req_to_token[req, p : p + PAGE] = torch.arange(pg * PAGE, (pg + 1) * PAGE)
            locs.append(int(self.req_to_token[req, p]))
        self.lens[req] += n
        return torch.tensor(locs, dtype=torch.int64, device=self.req_to_token.device)

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        self.req_to_token[dst, :n] = self.req_to_token[src, :n]
        self.lens[dst] = n


class Layers:
    """What the backend reads from the model's layers: RadixAttention-like records, the compressor, the sink;
    `hca` / `mla` None where the geometry has no layer of that kind."""

    def __init__(self, cfg, device, seed: int = 0):
        from sglang_ernie55.layers.attention import Compressor
        from sglang_ernie55.layers.rope import RopeTable, mla_softmax_scale

        g = torch.Generator().manual_seed(seed)
        self.rope = RopeTable(cfg).to(device)
        self.compressor = Compressor(cfg, self.rope).to(device)
        with torch.no_grad():
            self.compressor.ape.copy_(torch.randn(cfg.compress_ratio, cfg.head_dim, generator=g))
            self.compressor.norm.weight.copy_(1 + 0.1 * torch.randn(cfg.head_dim, generator=g))
        self.sink = torch.randn(cfg.num_attention_heads, generator=g).to(device)
        D, R, r = cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        kinds = list(cfg.layer_types)
        self.hca = self.mla = None
        if "hca" in kinds:
            self.hca = SimpleNamespace(layer_id=kinds.index("hca"), scaling=D**-0.5, v_head_dim=D)
        if "mla_dsa" in kinds:
            scale = mla_softmax_scale(cfg.qk_nope_head_dim + r, cfg.rope_scaling)
            self.mla = SimpleNamespace(layer_id=kinds.index("mla_dsa"), scaling=scale, v_head_dim=R)


def _bf16(x):
    return x.bfloat16().float()


def make_inputs(cfg, T: int, g: torch.Generator, device) -> dict:
    h, D, R, r = cfg.num_attention_heads, cfg.head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    # the compressor rows as the HCA layer hands them over: a column slice of its merged x_proj output (fp32
    # here; tests/kernels/test_hca_compress.py checks that bf16 rows store what their fp32 values store)
    wide = torch.cat([rn(T, 32), rn(T, D), 2 * rn(T, D), rn(T, 16)], 1)
    x = dict(
        q=_bf16(rn(T, h, D)),
        kv=rn(T, D),
        cs=wide[:, 32 : 32 + 2 * D],
        mq=_bf16(rn(T, h, R + r)),
        kc=rn(T, R + r),
        iq=_bf16(rn(T, nI, dI)),
        iw=rn(T, nI) * (nI * dI) ** -0.5,
        ik=rn(T, dI),
    )
    return {k: v.to(device) for k, v in x.items()}


def run_batch(be, layers, fb, x, decode: bool, graph: bool = False) -> dict:
    """One forward of the layers (HCA and / or MLA-DSA) through backend `be`; returns their attention outputs."""
    if graph:
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        be.init_forward_metadata_in_graph(fb)
    else:
        be.init_forward_metadata(fb)
    fwd = be.forward_decode if decode else be.forward_extend
    out = {}
    if layers.hca is not None:
        out["hca"] = fwd(x["q"], x["kv"], x["kv"], layers.hca, fb, ernie_inputs=hca_inputs(layers, x)).float()
    if layers.mla is not None:
        v = x["kc"][:, : layers.mla.v_head_dim]
        out["mla"] = fwd(x["mq"], x["kc"], v, layers.mla, fb, ernie_inputs=mla_inputs(x)).float()
    return out


def hca_inputs(layers, x):
    from sglang_ernie55.attention.interface import HCAInputs

    return HCAInputs(x["cs"], layers.compressor, layers.sink)


def mla_inputs(x):
    from sglang_ernie55.attention.interface import MLAInputs

    return MLAInputs(x["iq"], x["iw"], x["ik"])


def pool_buffers(pool) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("win", "cmp", "latent", "index_k"):
        for lid, rows in getattr(pool, name).items():
            out[f"{name}{lid}"] = rows.pool
    for lid, st in pool.state.items():
        out[f"state{lid}"] = st
    return out


def snapshot(pool) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pool_buffers(pool).items()}


def restore(pool, snap) -> None:
    for k, v in pool_buffers(pool).items():
        v.copy_(snap[k])


def _fb(mode, loc, req, seq, prefix=None, ext=None, draft_tokens: int | None = None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dev = loc.device
    seq_t = torch.tensor(seq, device=dev)
    fm = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "verify": ForwardMode.TARGET_VERIFY}[
        mode
    ]
    return SimpleNamespace(
        forward_mode=fm,
        out_cache_loc=loc,
        req_pool_indices=torch.tensor(req, device=dev),
        seq_lens=seq_t,
        seq_lens_cpu=seq_t.cpu(),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
        batch_size=len(req),
        spec_info=SimpleNamespace(draft_token_num=draft_tokens),
    )


def _tol(kv: str, device: str) -> float:
    """Relative (to the output's max |value|) tolerance of kernel vs twin attention outputs: fp32 dots in
    the interpreter; bf16 MMA operands (P and V) with fp32 accumulation on the GPU (FlashMLA too)."""
    return 1e-5 if device == "cpu" else 2e-2


def compare(
    cfg,
    pool,
    got: dict,
    want: dict,
    snap_g: dict,
    snap_w: dict,
    kv: str,
    device: str,
    tag: str,
    lens: list[int],
):
    """Outputs within tolerance; window / latent / indexer rows and the open-block state rows equal (the rows
    a later batch can read: those of every live request's last ring // ratio blocks); compressed entries
    close."""
    from sglang_ernie55.kernels import torch_twin as kref

    rep = {}
    for k in want:
        scale = float(want[k].abs().max())
        err = float((got[k] - want[k]).abs().max())
        rep[f"{k}_max_abs"], rep[f"{k}_scale"] = err, scale
        assert torch.isfinite(got[k]).all(), f"{tag}: {k} output not finite"
        assert err <= _tol(kv, device) * scale, (
            f"{tag}: {k} output max |diff| {err} > {_tol(kv, device)} x {scale}"
        )
    for name in snap_w:
        a, b = snap_g[name], snap_w[name]
        if name.startswith("cmp"):
            g = pool.cmp[int(name[3:])].geom
            slots = torch.arange(pool.cmp_rows - 1, device=a.device)  # the scratch row is the twin's own
            da, db = kref.pool_gather(a, g, slots), kref.pool_gather(b, g, slots)
            err = float((da - db).abs().max())
            rep[f"{name}_max_abs"] = err
            rep[f"{name}_bytes_equal"] = float(
                (a[:-1] == b[:-1]).float().mean()
            )  # last page: the scratch row
            tol = 0.13 if kv == "fp8_e4m3" else 8e-3  # one e4m3 / bf16 rounding step of |entry| ~ 1
            assert err <= tol * float(db.abs().max()), f"{tag}: compressed entries differ by {err}"
        elif name.startswith("state"):
            ratio, ring = cfg.compress_ratio, a.shape[1]  # ring: 1 block, or 2 under speculative decoding
            for req, n in enumerate(lens):
                first = max(0, ratio * (n // ratio - ring // ratio + 1))
                rows = torch.arange(first, n, device=a.device) % ring
                assert torch.equal(a[req, rows], b[req, rows]), (
                    f"{tag}: {name} open-block rows of slot {req} differ"
                )
        else:
            # page 0 is SGLang's padding page: every padded CUDA-graph row writes its rows there (a padded
            # verify request writes S+1 rows to the same slot: which one lands is the GPU's order, seen on
            # the H200), and nothing ever reads it
            a, b = a[1:], b[1:]
            assert torch.equal(a, b), f"{tag}: {name} bytes differ ({int((a != b).sum())} bytes)"
    return rep


class SessionSlots:
    """Slots over twin_harness.Session's allocator (SGLang's SWATokenToKVPoolAllocator with swa_pages)."""

    def __init__(self, session):
        self.s, self.req_to_token, self.lens = session, session.req_to_token, session.lens

    def alloc(self, req: int, n: int, decode: bool = False) -> torch.Tensor:
        loc = self.s.alloc_tokens(req, n, decode=decode)
        self.s.lens[req] += n
        return loc.to(self.req_to_token.device)

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        self.s.share_prefix(src, dst, n)


class BackendRun:
    """One pool, the twin and the backends under test over it, the two layers, and the batch helpers."""

    def __init__(self, kv, device, geometry, impls, pool, slots, cfg, prepare=None):
        from sglang_ernie55.attention.backend import Ernie55AttnBackend

        self.kv, self.device, self.pool, self.slots, self.cfg = kv, device, pool, slots, cfg
        runner = SimpleNamespace(
            token_to_kv_pool=pool,
            model_config=SimpleNamespace(hf_config=cfg),
            req_to_token_pool=SimpleNamespace(req_to_token=slots.req_to_token),
        )
        self.twin = Ernie55AttnBackend(runner, impl="torch")
        self.backs = {impl: Ernie55AttnBackend(runner, impl=impl) for impl in impls}
        for impl, be in self.backs.items():
            assert all(c.impl == impl for c in be.choice.values()), be.choice
            if prepare is not None:
                prepare(be)
        self.layers = Layers(cfg, device)
        self.g = torch.Generator().manual_seed(2)
        # whether decode / verify rows came from the fused metadata build (KernelPath.fused_fixed_meta)
        fused = {
            impl: all(getattr(i, "fused_meta", False) for i in be._distinct)
            for impl, be in self.backs.items()
        }
        # whether the MLA-DSA layers selected their keys with the one-launch top-k (kernels/indexer.py)
        fused_topk = {
            impl: all(getattr(i, "fused_topk", False) for i in be._distinct)
            for impl, be in self.backs.items()
        }
        # whether MLA-DSA extend rows ran FlashMLA's sparse prefill over a bf16 copy (KernelPath.mla_prefill)
        prefill = {
            impl: any(getattr(i, "mla_prefill", False) for i in be._distinct)
            for impl, be in self.backs.items()
        }
        # whether HCA extend rows ran FlashMLA's sparse prefill over a bf16 copy (KernelPath.hca_prefill)
        hca_prefill = {
            impl: any(getattr(i, "hca_prefill", False) for i in be._distinct)
            for impl, be in self.backs.items()
        }
        # the indexer logits' extend launch config (KernelPath.index_extend)
        index_extend = {
            impl: sorted({tuple(getattr(i, "index_extend", ())) for i in be._distinct} - {()})
            for impl, be in self.backs.items()
        }
        self.report: dict = {
            "kv": kv,
            "device": device,
            "geometry": geometry,
            "fused_meta": fused,
            "fused_topk": fused_topk,
            "mla_sparse_prefill": prefill,
            "hca_sparse_prefill": hca_prefill,
            "index_extend": index_extend,
            "steps": {},
        }

    def extend(self, reqs, ns):
        prefix = [self.slots.lens[r] for r in reqs]
        loc = torch.cat([self.slots.alloc(r, n) for r, n in zip(reqs, ns)])
        return _fb("extend", loc, reqs, [p + n for p, n in zip(prefix, ns)], prefix, list(ns)), sum(ns)

    def decode(self, reqs):
        if isinstance(self.slots, SessionSlots):
            loc = torch.cat([self.slots.alloc(r, 1, decode=True) for r in reqs])
        else:
            loc = torch.cat([self.slots.alloc(r, 1) for r in reqs])
        return _fb("decode", loc, reqs, [self.slots.lens[r] for r in reqs]), len(reqs)

    def verify(self, reqs, k: int):
        """A TARGET_VERIFY batch: k rows per request at positions lens .. lens + k - 1 (seq_lens = lens
        before them, as SGLang passes); slots of positions a rejected earlier verify mapped are kept."""
        before = [self.slots.lens[r] for r in reqs]
        loc = torch.cat([self.slots.alloc(r, k) for r in reqs])
        return _fb("verify", loc, reqs, before, draft_tokens=k), k * len(reqs)

    def graph_verify_padded(self, tag, reqs, k: int):
        """Verify in the decode graph runner's form: context-length widths and a padded request (slot 0,
        its k rows at loc 0, seq len 1, SGLang's fill value); graph-width == eager on the real rows."""
        fb, T = self.verify(reqs, k)
        dev = self.device
        fb = _fb(
            "verify",
            torch.cat([fb.out_cache_loc, torch.zeros(k, dtype=torch.int64, device=dev)]),
            list(reqs) + [0],
            fb.seq_lens_cpu.tolist() + [1],
            draft_tokens=k,
        )
        for be in (self.twin, *self.backs.values()):
            be.init_cuda_graph_state(len(reqs) + 1, T + k)
        self.compared(tag, fb, T + k, False, graph=True, real=T)

    def twin_only(self, fb, T, is_decode):
        run_batch(self.twin, self.layers, fb, make_inputs(self.cfg, T, self.g, self.device), is_decode)

    def compared(self, tag, fb, T, is_decode, graph=False, real: int | None = None):
        """`real`: rows whose outputs are compared (padded graph rows read garbage, their outputs are
        discarded; what they must not do is write live rows, which the pool comparison checks)."""
        pool, kv, device = self.pool, self.kv, self.device
        x = make_inputs(self.cfg, T, self.g, device)
        before = snapshot(pool)
        res = {}
        for impl, be in self.backs.items():
            restore(pool, before)
            out = run_batch(be, self.layers, fb, x, is_decode, graph=graph)
            res[impl] = (out, snapshot(pool))
        restore(pool, before)
        want = run_batch(self.twin, self.layers, fb, x, is_decode, graph=graph)
        snap_w = snapshot(pool)
        if real is not None:
            want = {k: v[:real] for k, v in want.items()}
            res = {i: ({k: v[:real] for k, v in o.items()}, sn) for i, (o, sn) in res.items()}
        self.report["steps"][tag] = {
            impl: compare(
                self.cfg, pool, out, want, snap, snap_w, kv, device, f"{tag}/{impl}", self.slots.lens
            )
            for impl, (out, snap) in res.items()
        }

    def graph_decode_padded(self, tag, reqs, pad_seq: int):
        """A CUDA-graph-style decode: context-length widths and a padded row (request slot 0, loc 0,
        seq len `pad_seq`); then the graph-width metadata gives the eager-width result on the real rows."""
        device = self.device
        fb, T = self.decode(reqs)
        fb = _fb(
            "decode",
            torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=torch.int64, device=device)]),
            list(reqs) + [0],
            [self.slots.lens[r] for r in reqs] + [pad_seq],
        )
        for be in (self.twin, *self.backs.values()):
            be.init_cuda_graph_state(T + 1, T + 1)
        self.compared(tag, fb, T + 1, True, graph=True, real=T)
        x = make_inputs(self.cfg, T + 1, self.g, device)
        before = snapshot(self.pool)
        for impl, be in self.backs.items():
            restore(self.pool, before)
            a = run_batch(be, self.layers, fb, x, True, graph=True)
            restore(self.pool, before)
            b = run_batch(be, self.layers, fb, x, True, graph=False)
            for k in a:
                err = float((a[k][:T] - b[k][:T]).abs().max())
                self.report["steps"][tag][impl][f"{k}_graph_vs_eager"] = err
                assert err <= _tol(self.kv, device) * float(b[k].abs().max()), (impl, k, err)
        restore(self.pool, before)


def run_backend(
    kv: str, device: str = "cpu", geometry: str = "tiny", impls=("triton",), prepare=None
) -> dict:
    """The batch sequence above; every implementation in `impls` against the twin (`prepare(backend)`: run on
    each backend under test once it is built). Returns the report."""
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    th.init_dist()
    cfg = geometry_config(geometry)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    num_pages, max_ctx, req_slots = 24, 4096 if geometry == "full" else 2048, 6
    pool = Ernie55TokenToKVPool(num_pages * PAGE, PAGE, dtype, cfg, num_req_slots=req_slots, device=device)
    slots = Slots(num_pages, max_ctx, req_slots, device)
    r = BackendRun(kv, device, geometry, impls, pool, slots, cfg, prepare)
    long = cfg.index_topk + 700 if geometry == "full" else 300  # > index_topk: the DSA top-k selects

    # twin only: request 0 open block of 120 rows (ratio 128; at a smaller ratio 120 % ratio rows), request 1
    # long (past index_topk), request 4 stale state
    r.twin_only(*r.extend([0, 1], [120, long]), False)
    r.twin_only(*r.extend([4], [77]), False)
    # A: mixed extend: request 0 completes block 0 from 120 state rows + 8 new rows, request 1 continues
    #    mid-block up to 1 token short of a block (which completes in decode below), request 2 is a fresh
    #    prefill completing two blocks from batch rows only and crossing a page
    n1 = 3 * cfg.compress_ratio - 1 - slots.lens[1] % (3 * cfg.compress_ratio)
    r.compared("mixed_extend", *r.extend([0, 1, 2], [20, n1, 260]), False)
    # A2: a short fresh prefill alone (every row shorter than index_topk: top-k rows padded with -1)
    r.compared("short_prefill", *r.extend([5], [30]), False)
    # B: prefix hit: request 3 starts with request 1's first page; slot 4 -> 3 carries stale state
    slots.share_prefix(1, 3, PAGE)
    for st in pool.state.values():
        st[3] = st[4]
    r.compared("prefix_hit", *r.extend([3], [12]), False)
    # C: batched decode; request 1 completes a block at step 0
    for step in range(3):
        r.compared(f"decode{step}", *r.decode([0, 1, 2, 3]), True)
    # D: graph-width decode; the padded row's seq len 128 would complete a block of live request 0
    r.graph_decode_padded("graph_decode_padded", [1, 2, 3], 128)
    return r.report


def fake_sparse_prefill(q, kv, sel, scale, d_v, sink=None):
    """FlashMLA's sparse prefill in torch, fp32 (the kernel's definition: softmax over the selected rows of kv
    [rows, 1, D], -1 none, the sink as one more logit with no value): stands in for the SM90 kernel where it
    cannot run, so that what the kernel path hands it is checked."""
    kvf = kv[:, 0].float()
    idx = sel.long()
    k = kvf[idx.clamp_min(0)]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), k) * scale
    s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
    m = s.amax(-1)
    if sink is not None:
        m = torch.maximum(m, sink.float()[None, :])
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + (torch.exp(sink.float()[None, :] - m) if sink is not None else 0.0)
    return torch.einsum("thk,tkd->thd", p, k[..., :d_v]) / den[..., None]


def run_backend_hca_prefill(kv: str, device: str = "cpu", geometry: str = "tiny") -> dict:
    """`run_backend` with the HCA layers' extend rows on the sparse-prefill path (`KernelPath.hca_prefill`:
    one bf16 copy of the batch's window and compressed rows, one index row per query over both) and their
    decode rows on the split kernel; `fake_sparse_prefill` stands in for FlashMLA's sparse prefill. Counts the
    prefill calls."""
    from sglang_ernie55.attention import kernel_path as kp
    from sglang_ernie55.configuration import LAYER_HCA
    from sglang_ernie55.kernels.sparse_attn import sparse_mqa_attention

    calls = []

    def prefill(q, kv_, sel, scale, d_v, sink=None):
        calls.append((tuple(q.shape), tuple(kv_.shape), tuple(sel.shape), sink is not None))
        return fake_sparse_prefill(q, kv_, sel, scale, d_v, sink)

    def decode(meta, key, q, main, extra, scale, d_v, sink):
        out = torch.empty(*q.shape[:2], d_v, dtype=torch.float32, device=q.device)
        sparse_mqa_attention(q, main, extra, sm_scale=scale, d_v=d_v, sink=sink, out=out)
        return out

    def prepare(be):
        for path in be._distinct:
            if isinstance(path, kp.KernelPath):
                path.flashmla, path.hca_prefill = frozenset({LAYER_HCA}), True

    saved = kp._flashmla_prefill, kp._flashmla
    kp._flashmla_prefill, kp._flashmla = prefill, decode
    try:
        rep = run_backend(kv, device, geometry, ("triton",), prepare)
    finally:
        kp._flashmla_prefill, kp._flashmla = saved
    rep["hca_prefill_calls"] = calls
    return rep


def run_backend_verify(
    kv: str, device: str = "cpu", geometry: str = "tiny", impls=("triton",), k: int = 4
) -> dict:
    """Speculative verify (TARGET_VERIFY, k = S+1 rows per request) on the two-block state ring: a verify
    whose rows cross a compression block (and a page), drafts rejected, the next verify over the same
    slots, then the graph form with a padded request; kernel path vs twin."""
    th.init_dist()
    cfg = geometry_config(geometry)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    R = cfg.compress_ratio
    s = th.Session(None, cfg, dtype, num_pages=24, max_ctx=4096, slots=4, state_blocks=2, device=device)
    slots = SessionSlots(s)
    r = BackendRun(kv, device, geometry, impls, s.pool, slots, cfg)
    r.twin_only(*r.extend([1, 2], [R - 2, 2 * R - 1]), False)
    r.compared("verify_cross_block", *r.verify([1, 2], k), False)  # rows R-2..R+1 and 2R-1..2R+2 (page 256)
    s.lens[1] -= k - 1  # request 1 accepts the bonus token only, request 2 all but the last draft
    s.lens[2] -= 1
    r.compared("verify_after_reject", *r.verify([1, 2], k), False)
    s.lens[1] -= k - 2
    r.graph_verify_padded("verify_graph_padded", [1, 2], k)
    return r.report


def run_backend_swa(kv: str, device: str = "cpu", geometry: str = "tiny", impls=("triton",)) -> dict:
    """Over the hybrid pool with a 3-page SWA pool under SGLang's own SWATokenToKVPoolAllocator: a 600-token
    request fills it, SGLang's out-of-window eviction frees its first SWA page, a fresh request gets that
    page (its window slots are not its full slots); then a mixed extend, decode and a graph-width decode
    with a padded row, kernel path vs twin (window rows compared byte for byte at their SWA slots)."""
    th.init_dist()
    cfg = geometry_config(geometry)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    long = cfg.index_topk + 600 if geometry == "full" else 600
    swa_pages = -(-long // PAGE)
    s = th.Session(None, cfg, dtype, num_pages=24, max_ctx=4096, slots=4, swa_pages=swa_pages, device=device)
    slots = SessionSlots(s)
    r = BackendRun(kv, device, geometry, impls, s.pool, slots, cfg)
    r.twin_only(*r.extend([1], [long]), False)
    assert s.allocator.swa_available_size() == 0
    assert len(s.evict_swa(1)) >= 1  # pre_len `long`: its first page left the window
    fb, T = r.extend([1, 2], [20, 200])
    live = s.req_to_token[2, :200].long()
    assert (s.pool.window_loc(live) != live).all(), "request 2's SWA slots equal its full slots"
    r.compared("swa_mixed_extend", fb, T, False)
    for step in range(2):
        r.compared(f"swa_decode{step}", *r.decode([1, 2]), True)
    r.graph_decode_padded("swa_graph_decode_padded", [1, 2], 128)
    return r.report


def run_backend_zero_extend(kv: str, device: str = "cpu", geometry: str = "tiny", impls=("triton",)) -> dict:
    """EXTEND batches where a request brings no new token (SGLang 0.5.23 never sends one, docs/serving-design.md
    6.3; the backend must still be exact if one comes): a zero-token request between, before and after live
    ones (its prefix mid-block, at a block boundary, past index_topk) gives, on the twin and every
    implementation, the outputs and the pool of the same batch without it; a batch whose every request
    brings none returns zero rows and leaves the pool byte for byte as it was."""
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    th.init_dist()
    cfg = geometry_config(geometry)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    pool = Ernie55TokenToKVPool(24 * PAGE, PAGE, dtype, cfg, num_req_slots=6, device=device)
    slots = Slots(24, 2048, 6, device)
    r = BackendRun(kv, device, geometry, impls, pool, slots, cfg)
    ratio = cfg.compress_ratio
    # request 0 mid-block (120), request 1 past index_topk (300), request 3 at a block boundary (2 blocks)
    r.twin_only(*r.extend([0, 1, 3], [120, 300, 2 * ratio]), False)
    backends = {"twin": r.twin, **r.backs}
    for tag, reqs, ns in (
        ("zero_between", [0, 1, 2], [20, 0, 30]),
        ("zero_first_and_last", [3, 0, 1], [0, 9, 0]),
    ):
        fb, T = r.extend(reqs, ns)
        r.compared(tag, fb, T, False)  # every implementation against the twin, as in `run_backend`
        live = [i for i, n in enumerate(ns) if n]
        without = _fb(
            "extend",
            fb.out_cache_loc,
            [reqs[i] for i in live],
            [int(fb.seq_lens_cpu[i]) for i in live],
            [fb.extend_prefix_lens_cpu[i] for i in live],
            [ns[i] for i in live],
        )
        x = make_inputs(cfg, T, r.g, device)
        before = snapshot(pool)
        for name, be in backends.items():
            restore(pool, before)
            want = run_batch(be, r.layers, without, x, False)
            snap_w = snapshot(pool)
            restore(pool, before)
            got = run_batch(be, r.layers, fb, x, False)
            snap_g = snapshot(pool)
            r.report["steps"][tag][f"{name}_vs_without"] = compare(
                cfg, pool, got, want, snap_g, snap_w, kv, device, f"{tag}/{name} vs without", slots.lens
            )
        restore(pool, snap_w)
    fb, T = r.extend([0, 1, 3], [0, 0, 0])
    x = make_inputs(cfg, T, r.g, device)
    before = snapshot(pool)
    rep = {}
    for name, be in backends.items():
        restore(pool, before)
        out = run_batch(be, r.layers, fb, x, False)
        rows = {k: list(v.shape) for k, v in out.items()}
        assert all(shape[0] == 0 for shape in rows.values()), (name, rows)
        changed = [k for k, v in pool_buffers(pool).items() if not torch.equal(v, before[k])]
        assert not changed, f"all_zero/{name}: a batch of no tokens wrote {changed}"
        rep[name] = rows
    r.report["steps"]["all_zero"] = rep
    return r.report


def rounded_twin_cls():
    """The twin fed exactly the bf16-rounded query tensors the kernel path hands its kernels (the HCA q,
    the MLA q = [q_nope W_uk | q_pe] and the indexer query): the kernel path's like-for-like oracle."""
    import dataclasses

    from sglang_ernie55.attention.backend import Ernie55AttnBackend
    from sglang_ernie55.attention.interface import MLAInputs

    def rounded(inputs):
        if isinstance(inputs, MLAInputs):
            return dataclasses.replace(inputs, index_q=_bf16(inputs.index_q))
        return inputs

    class RoundedTwin(Ernie55AttnBackend):
        def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, *, ernie_inputs):
            return super().forward_extend(
                _bf16(q), k, v, layer, fb, save_kv_cache, ernie_inputs=rounded(ernie_inputs)
            )

        def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, *, ernie_inputs):
            return super().forward_decode(
                _bf16(q), k, v, layer, fb, save_kv_cache, ernie_inputs=rounded(ernie_inputs)
            )

    return RoundedTwin


def _tiny_model(dtype: torch.dtype, device: str):
    """(config, SGLang model): the tiny preset in `dtype`, the reference's seed-0 weights, torch experts."""
    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.reference.model import build_reference

    th.init_dist()
    cfg = tiny_config()
    ref = build_reference(cfg, seed=0)
    model = th.build_model(cfg, dtype=dtype)
    model.load_weights(ref.state_dict().items())
    model = model.to(device)
    th.torch_experts(model)
    return cfg, model


def _prefill_chunk_decode(s, ids: torch.Tensor) -> torch.Tensor:
    """Request 0: a 100-token prefill, a 37-token chunk that completes block 0 from state rows, 3 decode
    steps; their logits, fp32 on the CPU."""
    parts = [s.extend([0], [ids[:100]]), s.extend([0], [ids[100:137]])]
    parts += [s.decode([0], [int(ids[137 + t])]) for t in range(3)]
    return torch.cat(parts).float().cpu()


def run_model(kv: str = "bfloat16", device: str = "cpu") -> dict:
    """Tiny model (fp32 weights) end to end: the kernel path vs the twin fed the same bf16-rounded queries
    (`rounded_twin_cls`), over a prefill, a chunk that completes block 0 from state rows, and decode; also
    reports the kernel path vs the plain twin (queries in fp32: DSA top-k near-ties and MoE routing flip)."""
    cfg, model = _tiny_model(torch.float32, device)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, cfg.vocab_size, (140,), generator=g)
    ids[0] = cfg.bos_token_id
    outs = {}
    for name, impl, cls in (
        ("kernel", "triton", None),
        ("rounded_twin", "torch", rounded_twin_cls()),
        ("twin", "torch", None),
    ):
        s = th.Session(
            model, cfg, dtype, num_pages=4, max_ctx=1024, slots=2, impl=impl, device=device, backend_cls=cls
        )
        outs[name] = _prefill_chunk_decode(s, ids)
    rep = {"kv": kv, "device": device, "positions": int(outs["kernel"].shape[0])}
    a = outs["kernel"]
    for name in ("rounded_twin", "twin"):
        b = outs[name]
        lp_a, lp_b = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        pick = a.argmax(-1)
        rep[name] = {
            "max_logit_diff": float((a - b).abs().max()),
            "logit_scale": float(b.abs().max()),
            "top1_equal": int((pick == b.argmax(-1)).sum()),
            "worst_top1_gap": float((lp_b.max(-1).values - lp_b.gather(1, pick[:, None])[:, 0]).max()),
            "max_logprob_diff": float(
                (lp_a.gather(1, pick[:, None]) - lp_b.gather(1, pick[:, None])).abs().max()
            ),
        }
    return rep


def run_query_dtype(kv: str = "bfloat16", device: str = "cpu") -> dict:
    """The tiny model in bf16 on the kernel path, twice: the layers emit their attention and indexer queries
    in the backend's query dtype (`ernie_query_dtype`: bf16, rounded once in the norm / RoPE / concat that
    makes them), then in fp32 for the backend to cast (`ernie_query_dtype` None). Reports the dtypes the
    backend received, whether the two runs' queries are equal bit for bit after the backend's casts, and
    whether their logits are."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        # bit-for-bit bf16 stores need the GPU's rounding (the interpreter truncates): tests/shim_lib
        from tests.shim_lib.triton_bf16 import install as _gpu_bf16_rounding

        why = _gpu_bf16_rounding()
        assert why is None, why
        # the layers' RoPE and norms on the kernels too (the CPU default is their torch math), where the
        # layers keep the projections' bf16 rows for an in-place rotation
        os.environ["SGLANG_ERNIE55_LAYER_IMPL"] = "triton"
    from sglang_ernie55.attention.interface import MLAInputs

    cfg, model = _tiny_model(torch.bfloat16, device)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (140,), generator=g)
    outs, queries, dtypes = {}, {}, {}
    for name, early in (("layer", True), ("backend", False)):
        s = th.Session(model, cfg, dtype, num_pages=4, max_ctx=1024, slots=2, impl="triton", device=device)
        if not early:
            s.backend.ernie_query_dtype = lambda kind: None
        seen, kinds = [], set()

        def recording(f, cast, seen=seen, kinds=kinds):
            def wrap(kind, q, kv, inputs, *a, **kw):
                # what the backend's own casts make of them: the attention and the indexer queries
                kinds.add((kind, str(q.dtype)))
                seen.append(q.to(cast).clone())
                if isinstance(inputs, MLAInputs):
                    kinds.add(("indexer", str(inputs.index_q.dtype)))
                    seen.append(inputs.index_q.to(cast).clone())
                return f(kind, q, kv, inputs, *a, **kw)

            return wrap

        for impl in s.backend._distinct:
            for method in ("extend", "rows"):
                setattr(impl, method, recording(getattr(impl, method), impl.query_dtype))
        outs[name], queries[name] = _prefill_chunk_decode(s, ids), seen
        dtypes[name] = [list(k) for k in sorted(kinds)]  # lists, as the report reads back from JSON
    a, b = queries["layer"], queries["backend"]
    return {
        "kv": kv,
        "dtypes": dtypes,
        "calls": len(a),
        "queries_equal": sum(int(torch.equal(x, y)) for x, y in zip(a, b)) if len(a) == len(b) else -1,
        "logits_equal": bool(torch.equal(outs["layer"], outs["backend"])),
        "max_logit_diff": float((outs["layer"] - outs["backend"]).abs().max()),
    }


def run_graph(
    kv: str, device: str = "cuda", geometry: str = "full", impls=("triton",), steps: int = 3
) -> dict:
    """Decode under a real CUDA graph: the backend's out-of-graph / in-graph metadata calls and both layers
    captured once on static buffers (3 live requests + 1 padded row), replayed `steps` times with new
    tokens (one completes a block) against eager kernel-path and twin decodes of the same batch."""
    from sglang_ernie55.attention.backend import Ernie55AttnBackend
    from sglang_ernie55.mem_cache.pool import Ernie55TokenToKVPool

    th.init_dist()
    cfg = geometry_config(geometry)
    dtype = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16
    num_pages, max_ctx, req_slots = 24, 4096, 4
    pool = Ernie55TokenToKVPool(num_pages * PAGE, PAGE, dtype, cfg, num_req_slots=req_slots, device=device)
    slots = Slots(num_pages, max_ctx, req_slots, device)
    runner = SimpleNamespace(
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(hf_config=cfg),
        req_to_token_pool=SimpleNamespace(req_to_token=slots.req_to_token),
    )
    twin = Ernie55AttnBackend(runner, impl="torch")
    layers = Layers(cfg, device)
    g = torch.Generator().manual_seed(3)
    long = cfg.index_topk + 300
    lens0 = [127, 300, long]  # request 1 completes block 0 at the first replay
    prefix = [0, 0, 0]
    loc = torch.cat([slots.alloc(r + 1, n) for r, n in enumerate(lens0)])
    fb = _fb("extend", loc, [1, 2, 3], lens0, prefix, lens0)
    run_batch(twin, layers, fb, make_inputs(cfg, sum(lens0), g, device), False)
    B = 4  # 3 live rows + 1 padded row (request slot 0, loc 0, seq len 1)
    static = SimpleNamespace(
        req=torch.tensor([1, 2, 3, 0], device=device),
        seq=torch.ones(B, dtype=torch.int64, device=device),
        loc=torch.zeros(B, dtype=torch.int64, device=device),
    )
    xs = make_inputs(cfg, B, g, device)
    fb_s = _fb("decode", static.loc, [1, 2, 3, 0], [1] * B)
    fb_s.req_pool_indices, fb_s.seq_lens, fb_s.out_cache_loc, fb_s.seq_lens_cpu = (
        static.req,
        static.seq,
        static.loc,
        None,
    )
    report: dict = {"kv": kv, "geometry": geometry, "steps": []}
    graphs = {}
    for impl in impls:
        be = Ernie55AttnBackend(runner, impl=impl)
        be.init_cuda_graph_state(B, B)
        snap = snapshot(pool)
        be.init_forward_metadata_out_graph(fb_s, in_capture=True)

        def captured(be=be):
            be.init_forward_metadata_in_graph(fb_s)
            o_h = be.forward_decode(
                xs["q"], xs["kv"], xs["kv"], layers.hca, fb_s, ernie_inputs=hca_inputs(layers, xs)
            )
            v = xs["kc"][:, : layers.mla.v_head_dim]
            o_m = be.forward_decode(xs["mq"], xs["kc"], v, layers.mla, fb_s, ernie_inputs=mla_inputs(xs))
            return {"hca": o_h, "mla": o_m}

        if device == "cpu":  # no graphs here: "replay" re-runs the captured body on the same static buffers
            graphs[impl] = (be, captured, None)
            restore(pool, snap)
            continue
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (compiles the Triton kernels)
            captured()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = captured()
        restore(pool, snap)
        graphs[impl] = (be, graph.replay, outs)
    for step in range(steps):
        new = torch.cat([slots.alloc(r, 1) for r in (1, 2, 3)])
        seq = [slots.lens[r] for r in (1, 2, 3)]
        static.loc.copy_(torch.cat([new, torch.zeros(1, dtype=torch.int64, device=device)]))
        static.seq.copy_(torch.tensor(seq + [1], device=device))
        x = make_inputs(cfg, B, g, device)
        for k in xs:
            xs[k].copy_(x[k])
        before = snapshot(pool)
        fb_e = _fb("decode", static.loc.clone(), [1, 2, 3, 0], seq + [1])
        want = run_batch(twin, layers, fb_e, x, True)
        snap_w = snapshot(pool)
        rep = {}
        for impl, (be, replay, outs) in graphs.items():
            restore(pool, before)
            res = replay()
            got = {k: v.float().clone() for k, v in (outs if outs is not None else res).items()}
            snap_g = snapshot(pool)
            restore(pool, before)
            eager = run_batch(be, layers, fb_e, x, True)
            rep[impl] = compare(
                cfg,
                pool,
                {k: v[:3] for k, v in got.items()},
                {k: v[:3] for k, v in want.items()},
                snap_g,
                snap_w,
                kv,
                device,
                f"graph{step}/{impl}",
                slots.lens,
            )
            for k in got:
                err = float((got[k][:3] - eager[k][:3]).abs().max())
                rep[impl][f"{k}_graph_vs_eager"] = err
                assert err <= _tol(kv, device) * float(eager[k][:3].abs().max()), (impl, step, k, err)
        restore(pool, snap_w)
        report["steps"].append(rep)
    return report


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fast_interpreter()  # test-only: Triton's interpreter without nested re-patching
    mode, kv = sys.argv[1], sys.argv[2]
    dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    geom = sys.argv[4] if len(sys.argv) > 4 else "tiny"
    impls = tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else ("triton",)
    if mode == "backend":
        print(json.dumps(run_backend(kv, dev, geom, impls)))
    elif mode == "backend_hca_prefill":
        print(json.dumps(run_backend_hca_prefill(kv, dev, geom)))
    elif mode == "backend_verify":
        print(json.dumps(run_backend_verify(kv, dev, geom, impls)))
    elif mode == "backend_zero_extend":
        print(json.dumps(run_backend_zero_extend(kv, dev, geom, impls)))
    elif mode == "backend_swa":
        print(json.dumps(run_backend_swa(kv, dev, geom, impls)))
    elif mode == "graph":
        print(json.dumps(run_graph(kv, dev, geom, impls)))
    elif mode == "query_dtype":
        print(json.dumps(run_query_dtype(kv, dev)))
    else:
        print(json.dumps(run_model(kv, dev)))
