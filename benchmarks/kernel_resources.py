"""Offline resource report of the sparse attention split kernel: compile it for sm_90 (Hopper) on a
machine without a GPU and print registers, spills and whether Hopper's wgmma is used.

The exact specialisations serving launches are captured, not retyped: `sparse_mqa_attention` is called on
CPU tensors of the serving shapes (64 heads; HCA window 128 + 1024 compressed entries with a sink; MLA-DSA
top-k 2048 at 512 + 64 rope), the kernel launch is intercepted, and Triton's own binder turns the real
arguments into the signature, constexprs and alignment attributes it would use on the GPU (the SM count is
pinned to the H200's 132, so the split count is the GPU's). Each is then compiled with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))``; the PTX is re-assembled with the bundled ptxas
``-v`` (Triton's flags) for the spill bytes, and the cubin read with the bundled ``cuobjdump
--dump-resource-usage``.

    python benchmarks/kernel_resources.py [--variant NAME ...] [--configs BH,BN,W,S ...] [--only hca_fp8 ...]
                                          [--keep DIR] [--json FILE]

Columns: registers per thread, spill stores / loads (bytes per thread, ptxas), stack frame (bytes per
thread, = the local memory Triton reports as ``n_spills`` in 4-byte words: the "spills" of docs/kernels.md),
shared memory (bytes, what the launch reserves), wgmma (Hopper warpgroup MMA in the PTX) or mma.sync.
Numbers come from the local Triton / ptxas; the GPU machine's Triton may allocate a little differently.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU (bf16 dot operands), never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from sparse_attn_dchunk import DChunk, sparse_attn_split_dc_kernel  # noqa: E402  (this folder)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sglang_ernie55.kernels import layout as L  # noqa: E402
from sglang_ernie55.kernels import sparse_attn as SA  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H = 64
DEFAULT_VARIANTS = ["base", "dchunk:64", "dchunk:128"]  # base, or dchunk:block_d (sparse_attn_dchunk.DChunk)
# (block_h, block_n, warps, stages): serving's default (it passes no tuning) first, the bench's chosen config, the
# "dchunk" candidates of bench_decode.py --variants, 16 warps
CONFIGS = [(64, 32, 8, 1), (64, 64, 8, 1), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 2), (64, 64, 16, 1)]


def _cases():
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
            torch.zeros(B, H, 512, dtype=torch.bfloat16),
            [SA.Scope(g.alloc(1), g, wi, ln), SA.Scope(gc.alloc(1), gc, ci, cl)],
            dict(sm_scale=512**-0.5, d_v=512, sink=torch.zeros(H), out=torch.empty(B, H, 512)),
        )
        gm = L.mla_geometry(kv)
        out[f"mla_{kv}"] = (
            torch.zeros(B, H, 576, dtype=torch.bfloat16),
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


def capture_split_launch(q, scopes, kw):
    """(kernel, args, kwargs) of the split-kernel launch that `sparse_mqa_attention` makes for these inputs."""
    got = {}
    kernels = [SA.sparse_attn_split_kernel, sparse_attn_split_dc_kernel]
    saved = {id(k): k.__dict__.get("run") for k in kernels}

    def grab(kern):
        def run(*args, grid, warmup, **kwargs):
            got.update(kernel=kern, args=args, kwargs=kwargs)
            raise _Captured

        return run

    sms = SA._num_sms
    try:
        SA._num_sms = lambda dev: 132  # the H200's SM count: the GPU's split count
        for k in kernels:
            k.run = grab(k)
        try:
            SA.sparse_mqa_attention(q, *scopes, **kw)
        except _Captured:
            pass
    finally:
        SA._num_sms = sms
        for k in kernels:
            if saved[id(k)] is None:
                k.__dict__.pop("run", None)
            else:
                k.run = saved[id(k)]
    return got["kernel"], got["args"], got["kwargs"]


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--variant",
        nargs="*",
        default=None,
        help=f"base, or dchunk[:block_d]: the split kernel of sparse_mqa_attention (default: {' '.join(DEFAULT_VARIANTS)})",
    )
    ap.add_argument(
        "--configs", nargs="*", default=None, help="BH,BN,W,S tuples (default: the bench configs)"
    )
    ap.add_argument("--only", nargs="*", default=None, help="cases: hca_fp8 hca_bf16 mla_fp8 mla_bf16")
    ap.add_argument("--keep", default=None, help="directory to keep the .ptx / .cubin files in")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = args.variant or DEFAULT_VARIANTS
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    cases = _cases()
    print(f"# sparse_attn split kernel, sm_90, triton {triton.__version__}, torch {torch.__version__}")
    print(
        "| variant | case | block_h, block_n, warps, stages | regs | spill st / ld (B) | stack (B) = words | shared (B) | MMA |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for var in variants:
        for name, (q, scopes, kw) in cases.items():
            if args.only and name not in args.only:
                continue
            for cfg in configs:
                ckw = dict(kw, block_h=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
                name_, _, bd = var.partition(":")
                if name_ == "dchunk":
                    ckw["split"] = DChunk(int(bd or 64))
                try:
                    kern, a, k = capture_split_launch(q, scopes, ckw)
                    r = resources(
                        compile_sm90(kern, a, k),
                        args.keep,
                        f"{var.replace(':', '')}_{name}_{'_'.join(map(str, cfg))}",
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"| {var} | {name} | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |||||")
                    continue
                mma = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "none")
                print(
                    f"| {var} | {name} | {cfg} | {r['regs']} | {r['spill_st']} / {r['spill_ld']} | "
                    f"{r['stack'] + r['local']} = {(r['stack'] + r['local']) // 4} | "
                    f"{r['shared']} | {mma} |",
                    flush=True,
                )
                rows.append(dict(variant=var, case=name, cfg=cfg, **r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
