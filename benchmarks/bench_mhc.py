"""An mHC site's pre-mapping (`kernels.mhc.hc_pre`: raw mix, RMS factor, Sinkhorn, the streams' combination
and the sub-layer's norm) at the full width (4 streams x 4096, fp32 streams) and prefill chunk sizes, two
ways: the cuBLAS fp32 mix GEMM then the tail, which reads the streams twice (`SGLANG_ERNIE55_MHC_MIX=cublas`,
the default), and the fused mix pass that also sums each row's squares, so the tail reads them once
(`fused`), in `MIX_CONFIG` and the other configs swept here. Each row: the time against the byte floor of
this design (the streams read twice, since the tail's combination needs the whole row's mix first, and the
bf16 output written, at the copy bandwidth measured in the same run); the fused results against the cublas
ones.

    python benchmarks/bench_mhc.py [--tokens 1024 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import bench, copy_bandwidth  # noqa: E402
from sglang_ernie55.kernels import mhc as MH  # noqa: E402

N, H = 4, 4096
CONFIGS = [MH.MIX_CONFIG] + [
    c
    for c in ((16, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 8, 4))
    if c != MH.MIX_CONFIG
]

POST_CONFIGS = [MH.POST_MIX_CONFIG] + [
    c for c in ((32, 32, 4, 3), (16, 64, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2)) if c != MH.POST_MIX_CONFIG
]

POST_TABLE = """
A site's post and the next site's pre, three ways: hc_post then hc_pre with the cublas mix, hc_post then
hc_pre with the fused mix, and hc_post_mix (the mix taken as R' is written) then hc_pre on its `mixed`. Byte
floor: R read, f read, R' written, R' read once by the tail, the bf16 output written."""


def _pair(site, mix):
    """hc_post, then the next site's hc_pre with `mix`."""
    f, R, post, C, fn, base, scale, kw = site
    return MH.hc_pre(MH.hc_post(f, R, post, C), fn, base, scale, mix=mix, **kw)


def _post_mix_pair(site, cfg):
    """hc_post_mix in `cfg`, then the next site's hc_pre on its `mixed`."""
    f, R, post, C, fn, base, scale, kw = site
    R2, mixed = MH.hc_post_mix(f, R, post, C, fn, config=cfg)
    return MH.hc_pre(R2, fn, base, scale, mixed=mixed, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192], help="rows per call")
    ap.add_argument("--out", help="folder for bench_mhc.jsonl (appended)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the timings are CUDA-graph replays)")
    tbs = copy_bandwidth()
    rows = []
    print(f"# {torch.cuda.get_device_name()}, copy {tbs:.2f} TB/s, {N} streams x {H}, fp32 streams, bf16 out")
    print("| tokens | mix | config | us | byte floor us | x floor | max rel diff vs cublas |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        R = torch.randn(T, N, H, device="cuda", generator=g)
        fn = torch.randn((2 + N) * N, N * H, device="cuda", generator=g) * (N * H) ** -0.5
        base, scale = torch.randn((2 + N) * N, device="cuda") * 0.5, torch.rand(3, device="cuda") + 0.5
        norm = MH.SublayerNorm(torch.ones(H, device="cuda"), 1e-6, torch.bfloat16)
        kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6, norm=norm)
        floor_us = (2 * R.numel() * 4 + T * H * 2) / (tbs * 1e12) * 1e6
        ref = MH.hc_pre(R, fn, base, scale, mix="cublas", **kw)
        us = bench(functools.partial(MH.hc_pre, R, fn, base, scale, mix="cublas", **kw)) * 1e3
        rows.append(dict(tokens=T, mix="cublas", config=None, us=us, floor_us=floor_us, diff=0.0))
        for cfg in CONFIGS:
            saved, MH.MIX_CONFIG = MH.MIX_CONFIG, cfg
            try:
                got = MH.hc_pre(R, fn, base, scale, mix="fused", **kw)
                diff = max(
                    float((a.float() - b.float()).abs().max() / b.float().abs().max())
                    for a, b in zip(got, ref)
                )
                us = bench(functools.partial(MH.hc_pre, R, fn, base, scale, mix="fused", **kw)) * 1e3
            finally:
                MH.MIX_CONFIG = saved
            rows.append(dict(tokens=T, mix="fused", config=list(cfg), us=us, floor_us=floor_us, diff=diff))
        for r in rows[-1 - len(CONFIGS) :]:
            cfg = "-" if r["config"] is None else "x".join(map(str, r["config"]))
            print(
                f"| {T} | {r['mix']} | {cfg} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                f"{r['us'] / r['floor_us']:.2f} | {r['diff']:.1e} |"
            )
    print()
    print(POST_TABLE)
    print("| tokens | way | config | us | byte floor us | x floor | max rel diff vs cublas |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for T in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(T + 1)
        R = torch.randn(T, N, H, device="cuda", generator=g)
        f = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        post = torch.rand(T, N, device="cuda", generator=g) * 2
        C = torch.softmax(torch.randn(T, N, N, device="cuda", generator=g), -1)
        fn = torch.randn((2 + N) * N, N * H, device="cuda", generator=g) * (N * H) ** -0.5
        base, scale = torch.randn((2 + N) * N, device="cuda") * 0.5, torch.rand(3, device="cuda") + 0.5
        norm = MH.SublayerNorm(torch.ones(H, device="cuda"), 1e-6, torch.bfloat16)
        kw = dict(hc_eps=1e-6, iters=20, rms_eps=1e-6, norm=norm)
        floor_us = (3 * R.numel() * 4 + 2 * T * H * 2) / (tbs * 1e12) * 1e6

        site = (f, R, post, C, fn, base, scale, kw)
        ref = _pair(site, "cublas")
        ways = [("post + cublas mix", None, functools.partial(_pair, site, "cublas"))]
        ways.append(("post + fused mix", None, functools.partial(_pair, site, "fused")))
        ways += [("post_mix", cfg, functools.partial(_post_mix_pair, site, cfg)) for cfg in POST_CONFIGS]
        for way, cfg, call in ways:
            got = call()
            diff = max(
                float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, ref)
            )
            us = bench(call) * 1e3
            rows.append(
                dict(tokens=T, mix=way, config=cfg and list(cfg), us=us, floor_us=floor_us, diff=diff)
            )
            c = "-" if cfg is None else "x".join(map(str, cfg))
            print(f"| {T} | {way} | {c} | {us:.1f} | {floor_us:.1f} | {us / floor_us:.2f} | {diff:.1e} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        with open(os.path.join(args.out, "bench_mhc.jsonl"), "a") as f:
            for r in rows:
                f.write(
                    json.dumps(dict(stamp=stamp, device=torch.cuda.get_device_name(), copy_tbs=tbs, **r))
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
