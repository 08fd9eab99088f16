"""Offline resource report of the sparse attention split kernel: compile it for sm_90 (Hopper) on a
machine without a GPU and print registers, spills and whether Hopper's wgmma is used, for serving's default
launch (the first rows: no tuning arguments passed, as serving calls it) and for other head-dim chunks
(block_d) and launch configs. `--fused`: the one-launch kernels (decode metadata, indexer top-k, RMSNorm +
RoPE, the mHC tail with its sub-layer norm) at serving shapes instead, exit 1 when one does not compile (the
interpreter runs some code the compiler refuses).

The exact specialisations serving launches are captured, not retyped: `sparse_mqa_attention` is called on
CPU tensors of the serving shapes (64 heads; HCA window 128 + 1024 compressed entries with a sink; MLA-DSA
top-k 2048 at 512 + 64 rope), the kernel launch is intercepted, and Triton's own binder turns the real
arguments into the signature, constexprs and alignment attributes it would use on the GPU (the SM count is
pinned to the H200's 132, so the split count is the GPU's). Each is then compiled with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))``; the PTX is re-assembled with the bundled ptxas
``-v`` (Triton's flags) for the spill bytes, and the cubin read with the bundled ``cuobjdump
--dump-resource-usage``.

    python benchmarks/kernel_resources.py [--block-d N ...] [--configs BH,BN,W,S ...] [--only hca_fp8 ...]
                                          [--fp32] [--keep DIR] [--json FILE]
    python benchmarks/kernel_resources.py --fused [--keep DIR] [--json FILE]

Columns: registers per thread, spill stores / loads (bytes per thread, ptxas), stack frame (bytes per
thread, = the local memory Triton reports as ``n_spills`` in 4-byte words: the "spills" of docs/kernels.md),
shared memory (bytes, what the launch reserves; an sm_90 block may take at most 232448), wgmma (Hopper
warpgroup MMA in the PTX) or mma.sync. ``--fp32``: fp32 queries (the exactness mode: fp32 dot operands).
Numbers come from the local Triton / ptxas; the GPU machine's Triton may allocate a little differently.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU (bf16 dot operands), never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sglang_ernie55.kernels import layout as L  # noqa: E402
from sglang_ernie55.kernels import sparse_attn as SA  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H = 64
SMEM_MAX = 232448  # bytes of shared memory one sm_90 block may reserve
DEFAULT_BLOCK_D = [128, 64]  # head-dim chunks of the grid (serving's default is 128 at full width)
# (block_h, block_n, warps, stages): serving's default launch, then one stage, wider / narrower key blocks (the
# candidates of bench_decode.py --variants), 16 warps
CONFIGS = [(64, 32, 8, 2), (64, 32, 8, 1), (64, 64, 8, 1), (64, 64, 8, 2), (64, 16, 8, 2), (64, 64, 16, 1)]


def _cases(qdtype=torch.bfloat16):
    """name -> (q, scopes, kwargs) at the serving shapes (pools of one page: only the specialisation matters)."""
    B = 4
    out = {}
    for kv in ("fp8", "bf16"):
        g, gc = L.hca_geometry(kv), L.hca_geometry(kv, page_size=L.HCA_CMP_PER_PAGE)
        wi = torch.zeros(B, 128, dtype=torch.int32)
        ci = torch.zeros(B, 1024, dtype=torch.int32)
        ln = torch.full((B,), 128, dtype=torch.int32)
        cl = torch.full((B,), 1024, dtype=torch.int32)
        out[f"hca_{kv}"] = (
            torch.zeros(B, H, 512, dtype=qdtype),
            [SA.Scope(g.alloc(1), g, wi, ln), SA.Scope(gc.alloc(1), gc, ci, cl)],
            dict(sm_scale=512**-0.5, d_v=512, sink=torch.zeros(H), out=torch.empty(B, H, 512)),
        )
        gm = L.mla_geometry(kv)
        out[f"mla_{kv}"] = (
            torch.zeros(B, H, 576, dtype=qdtype),
            [
                SA.Scope(
                    gm.alloc(1),
                    gm,
                    torch.zeros(B, 2048, dtype=torch.int32),
                    torch.full((B,), 2048, dtype=torch.int32),
                )
            ],
            dict(sm_scale=192**-0.5, d_v=512, out=torch.empty(B, H, 512)),
        )
    return out


class _Captured(Exception):
    pass


def capture_launch(kern, call):
    """(kernel, args, kwargs) of the launch of `kern` that `call()` makes (the launch itself never runs)."""
    got = {}
    saved = kern.__dict__.get("run")

    def run(*args, grid, warmup, **kwargs):
        got.update(args=args, kwargs=kwargs)
        raise _Captured

    kern.run = run
    try:
        call()
    except _Captured:
        pass
    finally:
        if saved is None:
            kern.__dict__.pop("run", None)
        else:
            kern.run = saved
    return kern, got["args"], got["kwargs"]


def capture_split_launch(q, scopes, kw):
    """(kernel, args, kwargs) of the split-kernel launch that `sparse_mqa_attention` makes for these inputs."""
    sms = SA._num_sms
    SA._num_sms = lambda dev: 132  # the H200's SM count: the GPU's split count
    try:
        return capture_launch(SA.sparse_attn_split_kernel, lambda: SA.sparse_mqa_attention(q, *scopes, **kw))
    finally:
        SA._num_sms = sms


def fused_launches():
    """name -> (kernel, args, kwargs) of the one-launch kernels at serving shapes: the decode / verify metadata
    (window 128, ratio 128, 256-token pages, context 32K; with and without the SWA window mapping, 1 and 3 rows
    per request), the indexer top-k (64 rows over 32K keys, top-2048; cache slots and positions; each of its
    launch configurations), the indexer logits (512 rows over 32K keys; serving's configs and two of several
    rows per program), the RMSNorm with and without the fused RoPE of the tail (the HCA q and kv), and the
    mHC site's tail with and without the sub-layer RMSNorm (full width, 64 tokens)."""
    from types import SimpleNamespace

    from sglang_ernie55.attention import kernel_path as kp
    from sglang_ernie55.kernels import decode_meta as DM
    from sglang_ernie55.kernels import indexer as IX

    out = {}
    page, slots, width, B = 256, 8, 32768, 4
    r2t = torch.arange(slots * width, dtype=torch.int32).view(slots, width) + page
    cfg = SimpleNamespace(window_size=128, compress_ratio=128, index_topk=2048)
    for mapped in (False, True):
        mapping = torch.arange(2 * (slots * width + page)) if mapped else None
        pool = SimpleNamespace(page_size=page, is_hybrid_swa=mapped, full_to_swa_index_mapping=mapping)
        pool.window_loc = (lambda full, m=mapping: m[full.long()]) if mapped else None
        path = kp.KernelPath(pool, r2t, cfg, fused_meta=False, fused_topk=False)
        for per_req in (1, 3):
            req, seq = torch.arange(B), torch.full((B,), 1000)
            loc = torch.arange(B * per_req, dtype=torch.int64) + page
            out[f"decode_meta{'_mapped' if mapped else ''}_rows{per_req}"] = capture_launch(
                DM.decode_meta_kernel,
                functools.partial(path.fused_fixed_meta, req, seq - per_req, per_req, loc, per_req, width),
            )
    lg = torch.randn(64, width)
    pos = torch.full((64,), width - 1, dtype=torch.int32)
    q_req = torch.zeros(64, dtype=torch.int32)
    pt = torch.zeros(1, width // page, dtype=torch.int32)
    for _rows, (blk, warps, sample) in IX.TOPK_CONFIGS:  # each launch configuration serving may pick
        tag, plain = f"{blk}x{warps}w", (blk, warps, 0)
        out[f"indexer_topk_slots_{tag}"] = capture_launch(
            IX.indexer_topk_kernel,
            functools.partial(IX.indexer_topk, lg, pos, 2048, pt, q_req, page, config=plain),
        )
        out[f"indexer_topk_positions_{tag}"] = capture_launch(
            IX.indexer_topk_kernel, functools.partial(IX.indexer_topk, lg, pos, 2048, config=plain)
        )
        out[f"indexer_topk_slots_{tag}_sampled"] = capture_launch(  # the sampled threshold (config's 3rd)
            IX.indexer_topk_kernel,
            functools.partial(
                IX.indexer_topk, lg, pos, 2048, pt, q_req, page, config=(blk, warps, sample or 2048)
            ),
        )
    from sglang_ernie55.kernels import layout as L

    # the indexer logits of an extend chunk (512 rows x 32K keys, fp8 pool): serving's configs and the
    # several-rows kernel in configs bench_indexer.py sweeps
    g, T = L.idx_geometry("fp8"), 512
    ipool = torch.zeros(width // page, g.page_bytes, dtype=torch.uint8)
    ipt = torch.arange(width // page, dtype=torch.int32).view(1, -1)
    qI, wI = torch.randn(T, 64, 128).to(torch.bfloat16), torch.randn(T, 64)
    ireq, ipos = torch.zeros(T, dtype=torch.int32), torch.arange(width - T, width, dtype=torch.int32)
    # serving's two launches, the one-row extend variant, the rows kernel at 2 rows and at 8 warps
    for cfg in (
        IX.LOGITS_EXTEND,
        IX.LOGITS_DECODE,
        (128, 4, True, False),
        (64, 4, True, True, 2),
        (64, 8, True, True, 4),
    ):
        bn, wp, ext, km, *nr = cfg
        name = f"indexer_logits_{'extend' if ext else 'decode'}_{bn}x{wp}w{'_km' if km else ''}"
        out[name + (f"_rows{nr[0]}" if nr else "")] = capture_launch(
            IX.indexer_logits_rows_kernel if nr else IX.indexer_logits_kernel,
            functools.partial(IX.indexer_logits, qI, wI, ipool, g, ipt, ireq, ipos, width, config=cfg),
        )
    from sglang_ernie55.kernels import norm as NM

    T, cs = 64, torch.randn(64, 32)
    wide = torch.randn(
        T, 2560
    )  # the HCA layer's merged x_proj output: q_lora 1024 | kv 512 | compressor 1024
    for name, x, w, rope in (
        ("rms_norm_rope_q", torch.randn(T, 64, 512), None, (cs, cs)),  # the weightless per-head q norm
        ("rms_norm_rope_kv", wide[:, 1024:1536], torch.randn(512), (cs, cs)),  # kv_norm on its column slice
        ("rms_norm", wide[:, :1024], torch.randn(1024), None),  # q_norm, no rotation
    ):
        out[name] = capture_launch(
            NM.rms_norm_kernel, functools.partial(NM.rms_norm, x, w, 1e-6, None, rope=rope)
        )
    from sglang_ernie55.kernels import rope as RP

    # the HCA output's inverse rotation (bf16, FlashMLA's output) and the indexer's rotate-half
    o, ik = torch.randn(T, 64, 512).to(torch.bfloat16), torch.randn(T, 64, 128)
    out["rope_inverse_interleaved"] = capture_launch(
        RP.rope_inplace_kernel, functools.partial(RP.rope_, o, None, cs, cs, True)
    )
    out["rope_neox"] = capture_launch(
        RP.rope_inplace_kernel, functools.partial(RP.rope_, ik, None, cs, cs, neox=True, start=0)
    )
    from sglang_ernie55.kernels import mhc as MH

    # the mHC site's tail: plain (y fp32), with the sub-layer norm (bf16 out), hc_head + the final norm
    n, H = 4, 4096
    R, kw = torch.randn(T, n, H), dict(hc_eps=1e-6, rms_eps=1e-6)
    fn, base, scale = torch.randn((2 + n) * n, n * H), torch.randn((2 + n) * n), torch.rand(3)
    norm = MH.SublayerNorm(torch.randn(H), 1e-6, torch.bfloat16)
    for name, call in (
        ("hc_pre_tail", functools.partial(MH.hc_pre, R, fn, base, scale, iters=20, **kw)),
        ("hc_pre_tail_norm", functools.partial(MH.hc_pre, R, fn, base, scale, iters=20, norm=norm, **kw)),
        ("hc_head_norm", functools.partial(MH.hc_head, R, fn[:n], base[:n], scale[:1], norm=norm, **kw)),
    ):
        out[name] = capture_launch(MH.hc_pre_tail_kernel, call)
    # the fused mix (SGLANG_ERNIE55_MHC_MIX=fused) and the tail that takes its sums of squares
    out["hc_mix_fused"] = capture_launch(MH.hc_mix_kernel, functools.partial(MH.hc_mix_fused, R, fn))
    m, ss, y = torch.randn(T, (2 + n) * n), torch.rand(T), torch.empty(T, H)
    pre, post, C = torch.empty(T, n), torch.empty(T, n), torch.empty(T, n, n)
    tail = functools.partial(MH._tail, m, base, scale, R, y, pre, post, C, iters=20, head=False, rms=True)
    out["hc_pre_tail_ss"] = capture_launch(
        MH.hc_pre_tail_kernel, functools.partial(tail, norm=None, ss=ss, **kw)
    )
    # hc_post with the next site's fused mix (bf16 f, fp32 streams)
    f = torch.randn(T, H).to(torch.bfloat16)
    out["hc_post_mix"] = capture_launch(
        MH.hc_post_mix_kernel,
        functools.partial(MH.hc_post_mix, f, R, torch.rand(T, n), torch.rand(T, n, n), fn),
    )
    return out


def compile_sm90(kernel, args, kwargs):
    """Compile with Triton's own specialisation of ``args`` (as JITFunction.run would) for sm_90."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__
    )


def resources(c, keep: str | None = None, tag: str = "k") -> dict:
    ptx = c.asm["ptx"]
    d = keep or tempfile.mkdtemp(prefix="kres_")
    os.makedirs(d, exist_ok=True)
    p_ptx, p_cubin = os.path.join(d, f"{tag}.ptx"), os.path.join(d, f"{tag}.cubin")
    with open(p_ptx, "w") as f:
        f.write(ptx)
    with open(p_cubin, "wb") as f:
        f.write(c.asm["cubin"])
    arch = "sm_90a" if ".target sm_90a" in ptx else "sm_90"
    log = subprocess.run(
        [
            os.path.join(BIN, "ptxas"),
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={arch}",
            p_ptx,
            "-o",
            os.path.join(d, f"{tag}.ptxas.o"),
        ],
        capture_output=True,
        text=True,
    ).stderr
    ru = subprocess.run(
        [os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", p_cubin], capture_output=True, text=True
    ).stdout
    r = dict(
        regs=int(re.search(r"REG:(\d+)", ru).group(1)),
        stack=int(re.search(r"STACK:(\d+)", ru).group(1)),
        local=int(re.search(r"LOCAL:(\d+)", ru).group(1)),
        spill_st=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        spill_ld=int(re.search(r"(\d+) bytes spill loads", log).group(1)),
        wgmma="wgmma.mma_async" in ptx,
        mma_sync="mma.sync" in ptx,
        shared=c.metadata.shared,  # static + dynamic (what the launch reserves)
    )
    if not keep:
        for p in os.listdir(d):
            os.remove(os.path.join(d, p))
        os.rmdir(d)
    return r


def _launch_config(k: dict) -> tuple:
    """(block_h, block_n, warps, stages) and block_d of a captured launch's keyword arguments."""
    return (k["BH"], k["BN"], k["num_warps"], k["num_stages"]), k["DC"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--block-d",
        nargs="*",
        type=int,
        default=None,
        help=f"head-dim chunks of the config grid (default: {' '.join(map(str, DEFAULT_BLOCK_D))})",
    )
    ap.add_argument(
        "--configs", nargs="*", default=None, help="BH,BN,W,S tuples (default: the bench configs)"
    )
    ap.add_argument("--only", nargs="*", default=None, help="cases: hca_fp8 hca_bf16 mla_fp8 mla_bf16")
    ap.add_argument("--fp32", action="store_true", help="fp32 queries (the exactness mode)")
    ap.add_argument("--keep", default=None, help="directory to keep the .ptx / .cubin files in")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--fused",
        action="store_true",
        help="compile the one-launch kernels instead (decode metadata, indexer top-k); exit 1 if any fails",
    )
    args = ap.parse_args()
    if args.fused:
        return fused_report(args)
    block_ds = DEFAULT_BLOCK_D if args.block_d is None else args.block_d
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    cases = {
        n: c
        for n, c in _cases(torch.float32 if args.fp32 else torch.bfloat16).items()
        if not args.only or n in args.only
    }
    qd = "fp32" if args.fp32 else "bf16"
    print(
        f"# sparse_attn split kernel, sm_90, {qd} queries, triton {triton.__version__}, torch {torch.__version__}"
    )
    print(
        "| launch | block_d | case | block_h, block_n, warps, stages | regs | spill st / ld (B) | "
        "stack (B) = words | shared (B) | MMA |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    # serving's default first (no tuning arguments), then the grid
    runs = [("serving default", None, None)]
    runs += [("tuned", bd, cfg) for bd in block_ds for cfg in configs]
    rows = []
    for label, bd, cfg in runs:
        for name, (q, scopes, kw) in cases.items():
            ckw = dict(kw)
            if cfg is not None:
                ckw.update(block_h=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3], block_d=bd)
            try:
                kern, a, k = capture_split_launch(q, scopes, ckw)
                lcfg, lbd = _launch_config(k)
                tag = f"{label.replace(' ', '_')}_{lbd}_{name}_{'_'.join(map(str, lcfg))}"
                r = resources(compile_sm90(kern, a, k), args.keep, tag)
            except Exception as e:  # noqa: BLE001
                print(f"| {label} | {bd} | {name} | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |||||")
                continue
            mma = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "none")
            words = (r["stack"] + r["local"]) // 4
            smem = f"{r['shared']}" + (" (too much)" if r["shared"] > SMEM_MAX else "")
            print(
                f"| {label} | {lbd} | {name} | {lcfg} | {r['regs']} | {r['spill_st']} / {r['spill_ld']} | "
                f"{r['stack'] + r['local']} = {words} | {smem} | {mma} |",
                flush=True,
            )
            rows.append(dict(launch=label, block_d=lbd, case=name, cfg=lcfg, query=qd, **r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def fused_report(args) -> int:
    print(f"# one-launch kernels, sm_90, triton {triton.__version__}, torch {torch.__version__}")
    print("| kernel | regs | spill st / ld (B) | stack (B) | shared (B) |")
    print("| --- | --- | --- | --- | --- |")
    rows, failed = [], 0
    for name, (kern, a, k) in fused_launches().items():
        try:
            r = resources(compile_sm90(kern, a, k), args.keep, name)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} ||||", flush=True)
            continue
        print(
            f"| {name} | {r['regs']} | {r['spill_st']} / {r['spill_ld']} | {r['stack'] + r['local']} | "
            f"{r['shared']} |",
            flush=True,
        )
        rows.append(dict(kernel=name, **r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
