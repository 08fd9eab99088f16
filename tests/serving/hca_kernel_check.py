"""Run as a script with TRITON_INTERPRET=1 (no GPU) or on a GPU: the backend's Triton HCA path
(`Ernie55AttnBackend._hca_kernel`, helper-4's sparse MQA over PackedRows pools) against the torch twin
on one batch of window + compressed slots with -1 holes and a sink. Prints `max_abs scale` as JSON."""

from __future__ import annotations

import json
import sys

import torch
from sglang_ernie55.kernels.layout import hca_geometry

from sglang_ernie55.attention.backend import Ernie55AttnBackend, _masked_sink_attention
from sglang_ernie55.mem_cache.pool import PackedRows


def main(kv: str, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    D, r, h, B, W, NB = 128, 64, 16, 3, 128, 5
    win = PackedRows(hca_geometry(kv, D, r, 256), 1024, device)
    cmp = PackedRows(hca_geometry(kv, D, r, 2), 16, device)
    win.write(torch.arange(1024, device=device), torch.randn(1024, D, generator=g).to(device))
    cmp.write(torch.arange(16, device=device), torch.randn(16, D, generator=g).to(device))
    q = torch.randn(B, h, D, generator=g).bfloat16().float().to(device)
    sink = torch.randn(h, generator=g).to(device)
    widx = torch.randint(0, 1024, (B, W), generator=g)
    widx[0, :50] = -1
    cidx = torch.randint(0, 15, (B, NB), generator=g)
    cidx[1, 2:] = -1
    widx, cidx = widx.to(device), cidx.to(device)
    keys = torch.cat([win.read(widx.clamp(min=0)), cmp.read(cidx.clamp(min=0))], 1)
    want = _masked_sink_attention(q, keys, keys, torch.cat([widx >= 0, cidx >= 0], 1), sink, D**-0.5)
    got = Ernie55AttnBackend._hca_kernel(q, win, cmp, widx, cidx, sink, D**-0.5)
    return {"max_abs": float((got - want).abs().max()), "scale": float(want.abs().max())}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")))
