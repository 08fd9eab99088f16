"""Decode benchmarks at full-size dims: HCA sparse decode (window + compressed + sink) and MLA-DSA
sparse decode (top-k 2048, absorbed), fp8 and bf16 pools, ours vs FlashMLA (fp8; sgl-flash-mla legacy
SM90 kernels), plus the lightning indexer. Prints achieved TB/s against the measured copy bandwidth.

Bytes counted per call (the fewest a kernel must move): every gathered key once (bytes_per_token of
the pool), q read, o written (bf16), the index lists (int32). Timing: triton.testing.do_bench median.

    python benchmarks/bench_decode.py [--out DIR] [--quick]
    python benchmarks/bench_decode.py --variants [--quick] [--out DIR]   # split-kernel variants vs FlashMLA

``--variants`` times every candidate of ``VARIANT_CANDIDATES`` (the split kernel as serving launches it, then
other head-dim chunks / launch configs, docs/kernels.md) on the decode shapes (HCA fp8 / bf16 at batch 1 / 8 /
64 / 256 x 4K / 32K / 128K, MLA-DSA top-k 2048 at batch 1 / 8 / 64 / 256) next to FlashMLA (fp8), prints each
candidate's compile report once (registers, spills, wgmma) and the table, with ratios against serving's default.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch
import triton

from sglang_ernie55.configuration import HCA_COMPRESS_RATIO, SERVING_PAGE_SIZE
from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels.indexer import indexer_logits, indexer_topk, indexer_topk_torch
from sglang_ernie55.kernels.kv_store import kv_store
from sglang_ernie55.kernels.sparse_attn import (
    LAST_COMPILED,
    Scope,
    flashmla_sparse_attention,
    sparse_mqa_attention,
)

DEV = "cuda"
H = 64


REP_MS = 60


def bench(fn) -> float:
    """Median ms of CUDA-graph replays (no Python launch overhead in the number)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = bench(functools.partial(b.copy_, a))
    return 2 * n / ms / 1e9  # TB/s (read + write)


def fill(g, n_tokens, width):
    pages = -(-n_tokens // g.page_size)
    pool = torch.randint(0, 256, (pages, g.page_bytes), dtype=torch.uint8, device=DEV)
    step = 1 << 20
    for s in range(0, pages * g.page_size, step):
        e = min(s + step, pages * g.page_size)
        kv_store(
            pool,
            g,
            torch.arange(s, e, dtype=torch.int32, device=DEV),
            torch.randn(e - s, width, device=DEV, dtype=torch.bfloat16),
        )
    return pool


def pad64(n):
    return max(64, -(-n // 64) * 64)


def hca_inputs(kv, B, ctx):
    g = L.hca_geometry(kv)
    gc = L.hca_geometry(kv, page_size=L.HCA_CMP_PER_PAGE)
    n_cmp = ctx // HCA_COMPRESS_RATIO
    win = fill(g, B * SERVING_PAGE_SIZE, 512)
    cmp = fill(gc, B * n_cmp, 512)
    # each request: window = the last 128 of its own page (shuffled pages); its own compressed entries
    perm_p = torch.randperm(B, device=DEV)
    wi = (perm_p[:, None] * SERVING_PAGE_SIZE + 128 + torch.arange(128, device=DEV)[None, :]).to(torch.int32)
    wl = torch.full((B,), 128, dtype=torch.int32, device=DEV)
    ci = torch.full((B, pad64(n_cmp)), -1, dtype=torch.int32, device=DEV)
    ci[:, :n_cmp] = torch.randperm(B * n_cmp, device=DEV).view(B, n_cmp).to(torch.int32)
    cl = torch.full((B,), n_cmp, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H, 512, device=DEV, dtype=torch.bfloat16)
    sink = torch.randn(H, device=DEV)
    nbytes = B * (128 * g.bytes_per_token + n_cmp * gc.bytes_per_token + H * 512 * 4 + (128 + n_cmp) * 4)
    return q, Scope(win, g, wi, wl), Scope(cmp, gc, ci, cl), sink, nbytes


def mla_inputs(kv, B, topk=2048):
    g = L.mla_geometry(kv)
    pool = fill(g, B * topk, 576)
    idx = torch.randperm(B * topk, device=DEV).view(B, topk).to(torch.int32)
    ln = torch.full((B,), topk, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H, 576, device=DEV, dtype=torch.bfloat16)
    nbytes = B * (topk * g.bytes_per_token + H * (576 + 512) * 2 + topk * 4)
    return q, Scope(pool, g, idx, ln), nbytes


def have_flashmla() -> bool:
    try:
        import flash_mla  # noqa: F401

        return True
    except Exception as e:  # noqa: BLE001
        print(f"[flashmla unavailable: {e!r}]")
        return False


def kw(c):
    return dict(block_h=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3])


CONFIGS = [  # (block_h, block_n, num_warps, num_stages); serving's default launch first
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (64, 32, 8, 1),
    (64, 64, 8, 1),
    (64, 32, 16, 1),
    (64, 64, 16, 1),
    (64, 128, 16, 1),
]
# --sweep: the wider search (fewer heads per program = fewer accumulator registers per thread; the head
# blocks of one token launch next to each other, so their shared keys come from L2)
WIDE_CONFIGS = CONFIGS[:2] + [
    (32, 32, 4, 1),
    (32, 64, 4, 1),
    (32, 32, 8, 1),
    (32, 64, 8, 1),
    (32, 64, 8, 2),
    (32, 128, 8, 1),
    (16, 64, 4, 1),
    (16, 64, 4, 2),
    (16, 128, 4, 1),
    (16, 32, 2, 1),
]


def sweep(name, run, configs=None):
    best = None
    for c in configs or CONFIGS:
        try:
            ms = bench(lambda c=c: run(c))
        except Exception as e:  # noqa: BLE001
            print(f"  {name} config {c}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        ck = LAST_COMPILED.get("split")
        regs = f"regs {ck.n_regs} spills {ck.n_spills}" if hasattr(ck, "n_regs") else ""
        wg = ""
        try:
            wg = "wgmma" if "wgmma" in ck.asm["ptx"] else "mma.sync"
        except Exception:  # noqa: BLE001
            pass
        print(f"  {name} config {c}: {ms * 1e3:.1f} us {regs} {wg}")
        if best is None or ms < best[0]:
            best = (ms, c)
    return best[1]


def wide_sweep(kv: str, fm: bool) -> None:
    hq, hmain, hextra, hsink, nb = hca_inputs(kv, 64, 128 * 1024)
    sweep(
        f"hca {kv} b64 128K ({nb / 1e6:.0f} MB)",
        lambda c: sparse_mqa_attention(hq, hmain, hextra, sm_scale=512**-0.5, d_v=512, sink=hsink, **kw(c)),
        WIDE_CONFIGS,
    )
    if fm and kv == "fp8":
        us = bench(
            lambda: flashmla_sparse_attention(hq, hmain, hextra, sm_scale=512**-0.5, d_v=512, sink=hsink)
        )
        print(f"  hca fp8 b64 128K FlashMLA: {us * 1e3:.1f} us")
    hq = hmain = hextra = None
    mq, msc, nb = mla_inputs(kv, 64)
    sweep(
        f"mla {kv} b64 ({nb / 1e6:.0f} MB)",
        lambda c: sparse_mqa_attention(mq, msc, sm_scale=192**-0.5, d_v=512, **kw(c)),
        WIDE_CONFIGS,
    )
    if fm and kv == "fp8":
        print(
            f"  mla fp8 b64 FlashMLA: {bench(lambda: flashmla_sparse_attention(mq, msc, sm_scale=192**-0.5, d_v=512)) * 1e3:.1f} us"
        )


# --variants: (label, sparse_mqa_attention tuning kwargs; labels give block_d, then block_h, block_n, warps,
# stages). The first is serving's launch (no tuning kwargs: block_d 128, block_n 32, 8 warps, 2 stages), the
# reference of the ratios; the others are the configs where the offline sm_90 compile spills 0-12 words per
# thread (benchmarks/kernel_resources.py, docs/kernels.md).
VARIANT_CANDIDATES = [
    ("dc128 64,32,8,2 (serving default)", {}),
    ("dc128 64,32,8,1", dict(num_stages=1)),
    ("dc128 64,64,8,2", dict(block_n=64)),
    ("dc128 64,16,8,2", dict(block_n=16)),
    ("dc64 64,64,8,2", dict(block_d=64, block_n=64)),
]
VARIANT_QUICK = [0, 1, 2, 3]  # --quick: these candidates only


def _compile_report() -> str:
    ck = LAST_COMPILED.get("split")
    out = f"regs {ck.n_regs} spills {ck.n_spills}" if hasattr(ck, "n_regs") else "regs ?"
    try:
        out += " wgmma" if "wgmma" in ck.asm["ptx"] else " mma.sync"
    except Exception:  # noqa: BLE001
        pass
    return out


def variants_table(args, fm: bool, bw: float, stamp: str, props) -> int:
    """Every candidate of VARIANT_CANDIDATES (and FlashMLA for fp8) on the decode shapes; one table."""
    global REP_MS
    REP_MS = 30
    cands = [VARIANT_CANDIDATES[i] for i in VARIANT_QUICK] if args.quick else VARIANT_CANDIDATES
    batches, ctxs = ([1, 64, 256], [4096, 131072]) if args.quick else ([1, 8, 64, 256], [4096, 32768, 131072])
    reported: set = set()
    rows = []
    shapes = [("hca", kv, B, ctx) for kv in ("fp8", "bf16") for B in batches for ctx in ctxs]
    shapes += [("mla", kv, B, None) for kv in ("fp8", "bf16") for B in batches]
    for kind, kv, B, ctx in shapes:
        if kind == "hca":
            q, main_, extra, sink, nbytes = hca_inputs(kv, B, ctx)
            call = functools.partial(
                sparse_mqa_attention, q, main_, extra, sm_scale=512**-0.5, d_v=512, sink=sink
            )
            fcall = functools.partial(
                flashmla_sparse_attention, q, main_, extra, sm_scale=512**-0.5, d_v=512, sink=sink
            )
        else:
            q, main_, nbytes = mla_inputs(kv, B)
            call = functools.partial(sparse_mqa_attention, q, main_, sm_scale=192**-0.5, d_v=512)
            fcall = functools.partial(flashmla_sparse_attention, q, main_, sm_scale=192**-0.5, d_v=512)
        ref = call()[0].float()  # serving's default launch
        r = dict(kind=kind, kv=kv, batch=B, ctx=ctx, nbytes=nbytes, us={})
        for label, ckw in cands:
            try:
                o = call(**ckw)[0]
                err = ((o.float() - ref).norm() / ref.norm()).item()
                ms = bench(functools.partial(call, **ckw))
            except Exception as e:  # noqa: BLE001
                print(
                    f"  {kind} {kv} b{B} {ctx}: {label} failed {type(e).__name__}: {str(e)[:160]}", flush=True
                )
                continue
            r["us"][label] = ms * 1e3
            key = (label, kind, kv)
            if key not in reported:
                reported.add(key)
                print(
                    f"  compile {kind} {kv} {label}: {_compile_report()}; rel. diff vs default {err:.1e}",
                    flush=True,
                )
            if err > 2e-2:
                print(f"  WARNING {kind} {kv} b{B} {ctx} {label}: rel. diff vs default {err:.1e}", flush=True)
        r["flashmla_us"] = None
        if fm and kv == "fp8":
            import flash_mla

            try:
                r["flashmla_us"] = (
                    bench(functools.partial(fcall, sched_meta=flash_mla.get_mla_metadata()[0])) * 1e3
                )
            except Exception as e:  # noqa: BLE001
                print(f"  flashmla {kind} failed: {e!r}"[:200])
        print("ROW", json.dumps(r), flush=True)
        rows.append(r)
        q = main_ = extra = call = fcall = ref = None
        torch.cuda.empty_cache()

    labels = [c[0] for c in cands]
    base = labels[0]  # serving's default
    lines = [
        f"Measured {stamp} on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton "
        f"{triton.__version__}; copy bandwidth {bw:.2f} TB/s. Split-kernel candidates (block_h, block_n, warps, "
        f"stages), times in us (median of CUDA-graph replays); best = fastest candidate; ratios vs '{base}'.",
        "",
        "| kernel | kv | batch | context | "
        + " | ".join(labels)
        + " | best | best / default | FlashMLA | default / FlashMLA | best / FlashMLA |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in labels) + " | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        us = r["us"]
        best = min(us, key=us.get) if us else None
        ctx = "-" if r["ctx"] is None else f"{r['ctx'] // 1024}K"
        kname = "HCA decode" if r["kind"] == "hca" else "MLA-DSA decode (top-k 2048)"
        cells = [f"{us[lb]:.1f}" if lb in us else "-" for lb in labels]
        f = r["flashmla_us"]
        lines.append(
            " | ".join(
                [
                    f"| {kname}",
                    r["kv"],
                    str(r["batch"]),
                    ctx,
                    *cells,
                    best or "-",
                    f"{us[best] / us[base]:.2f}x" if best and base in us else "-",
                    "-" if f is None else f"{f:.1f}",
                    f"{us[base] / f:.2f}x" if base in us and f else "-",
                    f"{us[best] / f:.2f}x" if best and f else "-",
                ]
            )
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "variants_table.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(args.out, "variants.json"), "w") as fh:
            json.dump(
                dict(stamp=stamp, device=props.name, copy_tbs=bw, candidates=cands, rows=rows),
                fh,
                default=repr,
            )
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--sweep", action="store_true", help="only the wide config sweep at batch 64 (fp8 and bf16)"
    )
    ap.add_argument(
        "--variants", action="store_true", help="only the split-kernel variants table (vs FlashMLA)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    fm = have_flashmla()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# {stamp} on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}; measured copy bandwidth {bw:.2f} TB/s"
    )
    rows = []

    class _Rows(list):
        def append(self, r):  # print each row as it is measured (a cut-short run still reports)
            print("ROW", json.dumps(r), flush=True)
            super().append(r)

    rows = _Rows()

    if args.sweep:
        for kv in ("fp8", "bf16"):
            wide_sweep(kv, fm)
        return
    if args.variants:
        return variants_table(args, fm, bw, stamp, props)
    # --- config sweep on the 128K shapes
    hq, hmain, hextra, hsink, _ = hca_inputs("fp8", 64, 128 * 1024)
    hcfg = sweep(
        "hca fp8 b64 128K",
        lambda c: sparse_mqa_attention(hq, hmain, hextra, sm_scale=512**-0.5, d_v=512, sink=hsink, **kw(c)),
    )
    mq, msc, _ = mla_inputs("fp8", 64)
    mcfg = sweep("mla fp8 b64", lambda c: sparse_mqa_attention(mq, msc, sm_scale=192**-0.5, d_v=512, **kw(c)))
    hq = hmain = hextra = mq = msc = None
    print(f"chosen configs: hca {hcfg}, mla {mcfg}")
    # indexer config sweep (fp8, b 64, 32K)
    g = L.idx_geometry("fp8")
    ipool = fill(g, 64 * 32768, 128)
    ipt = torch.randperm(64 * 128, device=DEV).view(64, 128).to(torch.int32)
    iqr = torch.arange(64, dtype=torch.int32, device=DEV)
    iqp = torch.full((64,), 32767, dtype=torch.int32, device=DEV)
    iq = torch.randn(64, 64, 128, device=DEV, dtype=torch.bfloat16)
    iw = torch.randn(64, 64, device=DEV)
    icfg, ibest = None, None
    for c in [(1024, 64, 4, 3), (1024, 128, 8, 3), (2048, 128, 4, 2)]:
        try:
            ms = bench(
                functools.partial(
                    indexer_logits,
                    iq,
                    iw,
                    ipool,
                    g,
                    ipt,
                    iqr,
                    iqp,
                    32768,
                    keys_per_prog=c[0],
                    config=(c[1], c[2], False),
                    num_stages=c[3],
                )
            )
        except Exception as e:  # noqa: BLE001
            print(f"  indexer config {c}: failed {type(e).__name__}: {str(e)[:100]}")
            continue
        print(f"  indexer fp8 b64 32K config {c}: {ms * 1e3:.1f} us")
        if ibest is None or ms < ibest:
            icfg, ibest = c, ms
    ipool = None
    ikw = dict(keys_per_prog=icfg[0], config=(icfg[1], icfg[2], False), num_stages=icfg[3])

    batches = [1, 8, 64, 256]
    ctxs = [4096, 32768, 131072, 1 << 20]
    if args.quick:
        batches, ctxs = [1, 64], [4096, 131072]
    for kv in ["fp8", "bf16"]:
        for B in batches:
            for ctx in ctxs:
                if B * ctx > 256 * (1 << 20):
                    continue
                q, main_, extra, sink, nbytes = hca_inputs(kv, B, ctx)
                ms = bench(
                    functools.partial(
                        sparse_mqa_attention,
                        q,
                        main_,
                        extra,
                        sm_scale=512**-0.5,
                        d_v=512,
                        sink=sink,
                        **kw(hcfg),
                    )
                )
                fms = None
                if fm and kv == "fp8":
                    import flash_mla

                    meta = flash_mla.get_mla_metadata()[0]
                    try:
                        fms = bench(
                            functools.partial(
                                flashmla_sparse_attention,
                                q,
                                main_,
                                extra,
                                sm_scale=512**-0.5,
                                d_v=512,
                                sink=sink,
                                sched_meta=meta,
                            )
                        )
                    except Exception as e:  # noqa: BLE001
                        print(f"flashmla hca failed: {e!r}"[:200])
                rows.append(
                    dict(
                        kernel="HCA decode",
                        kv=kv,
                        batch=B,
                        ctx=ctx,
                        us=ms * 1e3,
                        tbs=nbytes / ms / 1e9,
                        flashmla_us=fms * 1e3 if fms else None,
                    )
                )
                q = main_ = extra = None
                torch.cuda.empty_cache()
        for B in batches:
            q, sc, nbytes = mla_inputs(kv, B)
            ms = bench(
                functools.partial(sparse_mqa_attention, q, sc, sm_scale=192**-0.5, d_v=512, **kw(mcfg))
            )
            fms = None
            if fm and kv == "fp8":
                import flash_mla

                meta = flash_mla.get_mla_metadata()[0]
                try:
                    fms = bench(
                        functools.partial(
                            flashmla_sparse_attention, q, sc, sm_scale=192**-0.5, d_v=512, sched_meta=meta
                        )
                    )
                except Exception as e:  # noqa: BLE001
                    print(f"flashmla mla failed: {e!r}"[:200])
            rows.append(
                dict(
                    kernel="MLA-DSA decode (topk 2048)",
                    kv=kv,
                    batch=B,
                    ctx=None,
                    us=ms * 1e3,
                    tbs=nbytes / ms / 1e9,
                    flashmla_us=fms * 1e3 if fms else None,
                )
            )
            q = sc = None
            torch.cuda.empty_cache()
        # lightning indexer (logits + top-k 2048), 64 heads x 128
        for B in [1, 8, 64]:
            for ctx in [4096, 32768, 131072]:
                if args.quick and ctx == 32768:
                    continue
                g = L.idx_geometry(kv)
                pool = fill(g, B * ctx, 128)
                npg = ctx // SERVING_PAGE_SIZE
                pt = torch.randperm(B * npg, device=DEV).view(B, npg).to(torch.int32)
                qr = torch.arange(B, dtype=torch.int32, device=DEV)
                qp = torch.full((B,), ctx - 1, dtype=torch.int32, device=DEV)
                qI = torch.randn(B, 64, 128, device=DEV, dtype=torch.bfloat16)
                w = torch.randn(B, 64, device=DEV)
                nbytes = B * ctx * (g.bytes_per_token + 4)
                ms = bench(functools.partial(indexer_logits, qI, w, pool, g, pt, qr, qp, ctx, **ikw))
                lg = indexer_logits(qI, w, pool, g, pt, qr, qp, ctx)
                ms_topk = bench(functools.partial(indexer_topk, lg, qp, 2048, pt, qr))
                ms_topk_torch = bench(functools.partial(indexer_topk_torch, lg, qp, 2048, pt, qr))
                rows.append(
                    dict(
                        kernel="indexer logits",
                        kv=kv,
                        batch=B,
                        ctx=ctx,
                        us=ms * 1e3,
                        tbs=nbytes / ms / 1e9,
                        flashmla_us=None,
                        topk_us=ms_topk * 1e3,
                        topk_torch_us=ms_topk_torch * 1e3,
                    )
                )
                pool = lg = None
                torch.cuda.empty_cache()

    lines = [
        f"Measured {stamp} on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}. Copy bandwidth (read + write, 2 GiB): **{bw:.2f} TB/s**. "
        f"Configs: HCA {hcfg}, MLA {mcfg}, indexer {icfg} (block_h, block_n, warps, stages). Times: median of CUDA-graph replays.",
        "",
        "| kernel | kv | batch | context | ours (us) | ours TB/s | % of copy BW | FlashMLA (us) | ours / FlashMLA | extra |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ctx = "-" if r["ctx"] is None else (f"{r['ctx'] // 1024}K" if r["ctx"] < (1 << 20) else "1M")
        f = r["flashmla_us"]
        extra = (
            "top-k {:.1f} us (torch top-k {:.1f} us)".format(r["topk_us"], r["topk_torch_us"])
            if "topk_us" in r
            else ""
        )
        fcol = "-" if f is None else f"{f:.1f}"
        ratio = "-" if f is None else "{:.2f}x".format(r["us"] / f)
        pct = 100 * r["tbs"] / bw
        lines.append(
            "| {} | {} | {} | {} | {:.1f} | {:.2f} | {:.0f}% | {} | {} | {} |".format(
                r["kernel"], r["kv"], r["batch"], ctx, r["us"], r["tbs"], pct, fcol, ratio, extra
            )
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_table.md"), "w") as fh:
            fh.write(table + "\n")
        with open(os.path.join(args.out, "bench.json"), "w") as fh:
            json.dump(
                dict(stamp=stamp, device=props.name, copy_tbs=bw, hca_cfg=hcfg, mla_cfg=mcfg, rows=rows), fh
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
