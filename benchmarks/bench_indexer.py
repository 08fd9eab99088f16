"""Lightning-indexer logits in prefill, as serving calls them: one indexer chunk (the rows x width budget of
attention/kernel_path.py, `INDEXER_LOGITS_BUDGET`) of one request's last rows, 64 heads x 128, keys read through
a shuffled page table from the fp8 (or bf16) indexer-key pool.

For each launch config of `indexer_logits` (keys per step, warps, variant, keys major, query rows per program,
stages; serving's extend config first) it prints the time, the FLOP rate (causal pairs x heads x 2 x head
dim) against the bf16 GEMM rate measured in the same run (the floor), and the peer: the same logits in torch
(one cuBLAS GEMM of every row's heads against the keys already dequantised outside the timing, ReLU, the
weighted head sum, the causal mask).
Every config's logits are checked against one row per program at 128 keys, heads major (itself checked
against the peer) before it is timed; a mismatch prints its size. Then the top-k over the
same logits: one program per row in serving's configs and others (keys per step, warps, and the sampled
threshold's sample size or 0), each checked against serving's and timed against its byte floor (the causal
logits read once at the copy bandwidth measured in the same run); then the chunk's last 1 and 64 rows
(decode-sized) in serving's config with each sample size.

    python benchmarks/bench_indexer.py [--ctx 8192 32768] [--kv fp8] [--topk-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import DEV, bench, copy_bandwidth, fill  # noqa: E402
from sglang_ernie55.attention.kernel_path import INDEXER_LOGITS_BUDGET  # noqa: E402
from sglang_ernie55.configuration import SERVING_PAGE_SIZE  # noqa: E402
from sglang_ernie55.kernels import layout as L  # noqa: E402
from sglang_ernie55.kernels.indexer import (  # noqa: E402
    LOGITS_DECODE,
    LOGITS_EXTEND,
    TOPK_CONFIGS,
    indexer_logits,
    indexer_topk,
    topk_config,
)
from sglang_ernie55.kernels.torch_twin import pool_gather  # noqa: E402

NI, DI, TOPK = 64, 128, 2048
# (keys per step, warps, keys major, rows per program) of the several-rows extend kernel: compiled for sm_90
# at this bench's shapes, registers <= 248 and no spills (32 keys x 4 warps with 4 or 8 rows spill); 8 rows at
# 64 keys are refused (`ROWS_HEADS_MAX`)
ROWS_CONFIGS = (
    (64, 4, True, 2),
    (128, 8, True, 2),
    (64, 4, True, 4),
    (64, 8, True, 4),
    (128, 8, True, 4),
    (64, 4, False, 2),
    (128, 8, False, 2),
    (32, 4, False, 4),
)


def gemm_rate() -> float:
    """bf16 GEMM FLOP/s of an 8192^3 torch matmul on this device."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = bench(functools.partial(torch.matmul, a, b))
    return 2 * 8192**3 / ms * 1e3


def peer(q, w, keys, pos):
    """The logits in torch: q [R, NI, DI] bf16, w [R, NI] fp32, keys [S, DI] bf16 (dequantised), pos [R]."""
    R, S = q.shape[0], keys.shape[0]
    sc = torch.relu(q.reshape(R * NI, DI) @ keys.T).view(R, NI, S).float()
    lg = torch.einsum("rhs,rh->rs", sc, w)
    return lg.masked_fill(torch.arange(S, device=DEV)[None, :] > pos[:, None], float("-inf"))


def topk_table(logits, pos, pt, req, S, bw, device, stamp) -> list[dict]:
    """Time `indexer_topk` over one chunk's logits in each launch config, then over its last 1 and 64 rows
    (decode-sized batches of rows near full width) in their serving config with each sample size; print a
    table, return its rows."""
    R = logits.shape[0]
    configs = [(*c, 0)[:3] for _rows, c in TOPK_CONFIGS]  # (keys per step, warps, sample)
    sweep = itertools.product((512, 1024, 2048), (4, 8), (0, 1024, 2048))
    runs = [(R, c) for c in configs + [c for c in sweep if c not in configs]]
    runs += [(r, (*topk_config(r)[:2], sample)) for r in (1, 64) if r < R for sample in (0, 1024, 2048)]
    print(f"\n## top-k {TOPK} over {S} keys (byte floor: the causal logits read once)", flush=True)
    print("| rows | keys/step | warps | sample | us | x floor |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    out, wants = [], {}
    for rows, (blk, wp, sample) in runs:
        lg, p, rq = logits[R - rows :], pos[R - rows :], req[R - rows :]
        floor_us = 4 * sum(min(int(x) + 1, S) for x in p.tolist()) / (bw * 1e12) * 1e6
        if rows not in wants:
            wants[rows] = indexer_topk(lg, p, TOPK, pt, rq)
        fn = functools.partial(indexer_topk, lg, p, TOPK, pt, rq, config=(blk, wp, sample))
        name = f"| {rows} | {blk} | {wp} | {sample} |"
        try:
            if not all(torch.equal(x, y) for x, y in zip(fn(), wants[rows])):
                print(f"{name} wrong selection: not timed | |")
                continue
            us = bench(fn) * 1e3
        except Exception as e:  # noqa: BLE001 (a config that does not compile: reported, the sweep goes on)
            print(f"{name} failed: {type(e).__name__} | |")
            continue
        out.append(
            dict(
                what="topk",
                keys=S,
                rows=rows,
                block=blk,
                warps=wp,
                sample=sample,
                us=us,
                x_floor=us / floor_us,
                device=device,
                at=stamp,
            )
        )
        print(f"{name} {us:.0f} | {us / floor_us:.1f} |", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[8192, 32768], help="sequence lengths (keys)")
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="indexer-key pool format")
    ap.add_argument(
        "--topk-only", action="store_true", help="serving's logits config only, then the top-k table"
    )
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_indexer.jsonl")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_indexer needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    rate = gemm_rate()
    bw = copy_bandwidth()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# {stamp} on {props.name}, torch {torch.__version__}, triton {triton.__version__}; "
        f"bf16 GEMM {rate / 1e12:.0f} TFLOP/s; copy {bw:.2f} TB/s; kv {a.kv}; serving's (keys per step, "
        f"warps, extend, keys major[, rows]): extend {LOGITS_EXTEND}, decode {LOGITS_DECODE}",
        flush=True,
    )
    first = [(*c[:4], c[4] if len(c) > 4 else 1, 3) for c in (LOGITS_EXTEND, LOGITS_DECODE)]
    configs = first + [
        c
        for c in itertools.product((32, 64, 128, 256), (4, 8), (True, False), (False, True), (1,), (3,))
        if c not in first
    ]
    # several query rows per program (extend variant): the shapes that compile for sm_90 without spills
    configs += [(bn, wp, True, km, r, 3) for bn, wp, km, r in ROWS_CONFIGS]
    if a.topk_only:
        configs = first[:1]
    rows_out = []
    g = L.idx_geometry(a.kv)
    for S in a.ctx:
        R = min(S, INDEXER_LOGITS_BUDGET // S)
        pages = -(-S // SERVING_PAGE_SIZE)
        pool = fill(g, pages * SERVING_PAGE_SIZE, DI)
        pt = torch.randperm(pages, device=DEV).view(1, pages).to(torch.int32)
        slots = (
            pt[0].long()[:, None] * SERVING_PAGE_SIZE + torch.arange(SERVING_PAGE_SIZE, device=DEV)
        ).view(-1)
        keys = pool_gather(pool, g, slots[:S]).to(torch.bfloat16)
        q = torch.randn(R, NI, DI, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(R, NI, device=DEV) * (NI**-0.5 * DI**-0.5)
        req = torch.zeros(R, dtype=torch.int32, device=DEV)
        pos = torch.arange(S - R, S, dtype=torch.int32, device=DEV)
        pairs = sum(range(S - R + 1, S + 1))
        flops = pairs * NI * DI * 2
        floor_us = flops / rate * 1e6
        want = peer(q, w, keys, pos)
        peer_us = bench(functools.partial(peer, q, w, keys, pos)) * 1e3
        # one row per program, heads major: the plainest launch is what every other config is checked against
        ref = indexer_logits(q, w, pool, g, pt, req, pos, S, config=(128, 4, True, False))
        fin = torch.isfinite(want)
        tol = 1e-3 * want[fin].abs().max().item()
        # the peer rounds each head's dot to bf16 (the GEMM's output dtype): agreement to that rounding
        bad = (
            (ref[fin] - want[fin]).abs().max().item()
            if torch.equal(torch.isfinite(ref), fin)
            else float("inf")
        )
        if bad > 20 * tol:
            print(
                f"the reference launch's logits differ from the torch peer's by {bad:.3g} "
                f"(max |logit| {tol * 1e3:.3g})"
            )
            return 1
        print(
            f"\n## {R} rows (positions {S - R} .. {S - 1}) x {S} keys: FLOP floor {floor_us:.0f} us; "
            f"torch peer {peer_us:.0f} us",
            flush=True,
        )
        print(
            "| keys/step | warps | variant | keys major | rows | stages | us | TFLOP/s | x floor "
            "| peer / ours |"
        )
        print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for bn, wp, ext, km, nr, st in configs:
            name = (
                f"| {bn} | {wp} | {'extend' if ext else 'decode'} | {'yes' if km else 'no'} | {nr} | {st} |"
            )
            fn = functools.partial(
                indexer_logits, q, w, pool, g, pt, req, pos, S, config=(bn, wp, ext, km, nr), num_stages=st
            )
            try:
                got = fn()
                # keys major sums the heads in another order: within fp32 rounding of the largest logit
                if not torch.equal(got, ref) and not torch.allclose(got, ref, rtol=1e-5, atol=1e-2 * tol):
                    same = torch.isfinite(got) == torch.isfinite(ref)
                    both = same & torch.isfinite(ref)
                    err = (got[both] - ref[both]).abs().max().item() if both.any() else float("nan")
                    print(
                        f"{name} wrong logits: not timed (max difference {err:.3g}, "
                        f"max |logit| {tol * 1e3:.3g}, "
                        f"{int((~same).sum())} finite / -inf mismatches) | | | |"
                    )
                    continue
                us = bench(fn) * 1e3
            except Exception as e:  # noqa: BLE001 (a config that does not compile: reported, the sweep goes on)
                print(f"{name} failed: {type(e).__name__} | | | |")
                continue
            tflops = flops / us / 1e6
            rows_out.append(
                dict(
                    kv=a.kv,
                    keys=S,
                    rows=R,
                    block_n=bn,
                    warps=wp,
                    variant="extend" if ext else "decode",
                    keys_major=km,
                    rows_per_program=nr,
                    stages=st,
                    us=us,
                    tflops=tflops,
                    x_floor=us / floor_us,
                    peer_us=peer_us,
                    device=props.name,
                    at=stamp,
                )
            )
            print(f"{name} {us:.0f} | {tflops:.0f} | {us / floor_us:.2f} | {peer_us / us:.2f} |", flush=True)
        rows_out += topk_table(ref, pos, pt, req, S, bw, props.name, stamp)
        pool = keys = want = ref = None
        torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_indexer.jsonl"), "a") as f:
            for r in rows_out:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
