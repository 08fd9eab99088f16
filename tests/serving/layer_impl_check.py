"""The model's per-layer compute on the Triton kernels vs the torch math (SGLANG_ERNIE55_LAYER_IMPL), tiny
config, fp32 weights.

Run as a script (`python layer_impl_check.py {pieces,model} [DEVICE]`, prints one JSON line; the CPU tests
run it with TRITON_INTERPRET=1 in a subprocess, so that the variable is set before Triton decorates the
kernels) or import `run_pieces` / `run_model` (a GPU run).

pieces: each decoder layer kind of the tiny model (0: dense FFN + HCA, 1: MLA-DSA + latent MoE, 2: HCA +
latent MoE) run whole, with its attention replaced by a recording stub (the backend is not under test: the
stub returns a fixed function of q / k / v), on fresh random streams and positions, T in {0, 1, 3, 19,
130}: the layer output R' and every tensor handed to the attention (q, k, v, the compressor's cs, the
indexer's qI / w / kI) with `triton` forced vs `torch`; hc_head; the MoE route (ids exactly equal, weights
close) on random inputs and on routers built with exact ties (groups of three identical experts, so the
top-k boundary always cuts a tie: the kernel must take the lowest id, as the reference's stable sort).

model: the tiny SGLang model end to end (fp32 weights, dense fp32 pool, the backend's torch twin) with the
layers on the kernels vs on torch and vs the reference model: a chunked prefill crossing the compression
block, decode steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import twin_harness as th  # noqa: E402

VAR = "SGLANG_ERNIE55_LAYER_IMPL"
TS = (0, 1, 3, 19, 130)


def _set(impl: str) -> None:
    os.environ[VAR] = impl


class StubAttention(nn.Module):
    """Stands in for RadixAttention: records what the layer hands the backend, returns a fresh fp32 tensor
    (HCA: o = q / 2 + kv; MLA-DSA: o_latent = q[..., :r] / 2 + v)."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, torch.Tensor] = {}

    def forward(self, q, k, v, forward_batch, ernie_kind: str, **kw):
        self.seen = {"q": q, "k": k, "v": v}
        self.seen.update({n: t for n, t in kw.items() if isinstance(t, torch.Tensor)})
        self.seen = {n: t.detach().clone().float() for n, t in self.seen.items()}
        if ernie_kind == "hca":
            return q.float() / 2 + k.float()[:, None, :]
        r = v.shape[-1]
        return q.float()[..., :r] / 2 + v.float()[:, None, :]


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.numel() == 0:
        return 0.0, 0.0
    return float((a.float() - b.float()).abs().max()), float(b.float().abs().max())


def _model(device: str):
    from sglang_ernie55.configuration import tiny_config
    from sglang_ernie55.reference.model import build_reference

    th.init_dist()
    cfg = tiny_config()
    ref = build_reference(cfg, seed=0)
    model = th.build_model(cfg, dtype=torch.float32)
    model.load_weights(ref.state_dict().items())
    model = model.to(device)
    th.torch_experts(model)
    return cfg, ref, model


def run_pieces(device: str = "cpu", tol: float = 1e-5) -> dict:
    cfg, _, model = _model(device)
    n, H = cfg.hc_mult, cfg.hidden_size
    layers = model.model.layers
    for layer in layers[:3]:
        layer.self_attn.attn = StubAttention()
    g = torch.Generator().manual_seed(7)
    rep: dict = {"tol": tol, "layers": {}}
    worst = 0.0
    with torch.no_grad():
        for T in TS:
            R = torch.randn(T, n, H, generator=g).to(device)
            pos = torch.randint(0, 5000, (T,), generator=g).to(device)
            for li in range(3):
                outs = {}
                for impl in ("torch", "triton"):
                    _set(impl)
                    out = layers[li](pos, R.clone(), None, torch.float32)
                    outs[impl] = {"R'": out, **layers[li].self_attn.attn.seen}
                assert set(outs["torch"]) == set(outs["triton"])
                for name in outs["torch"]:
                    d, scale = _diff(outs["triton"][name], outs["torch"][name])
                    rep["layers"][f"T{T}/layer{li}/{name}"] = [d, scale]
                    assert d <= tol * max(scale, 1.0), (T, li, name, d, scale)
                    worst = max(worst, d / max(scale, 1.0))
            heads = {}
            for impl in ("torch", "triton"):
                _set(impl)
                heads[impl] = model.model.hc_head(R)
            d, scale = _diff(heads["triton"], heads["torch"])
            rep["layers"][f"T{T}/hc_head"] = [d, scale]
            assert d <= tol * max(scale, 1.0), (T, "hc_head", d, scale)
        rep["route"] = _routes(cfg, layers[1].mlp, g, device)
    rep["worst_rel"] = worst
    return rep


def _route_both(moe, x):
    res = {}
    for impl in ("torch", "triton"):
        _set(impl)
        res[impl] = moe.route(x)
    return res


def _routes(cfg, moe, g, device) -> dict:
    """ids exactly equal, weights to fp32 rounding: random inputs, then routers with exact ties."""
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    out = {}
    for T in TS:
        x = torch.randn(T, cfg.hidden_size, generator=g).to(device)
        r = _route_both(moe, x)
        assert r["triton"][1].dtype == torch.int32 and r["triton"][0].dtype == torch.float32
        assert torch.equal(r["triton"][1], r["torch"][1]), T
        torch.testing.assert_close(r["triton"][0], r["torch"][0], atol=1e-6, rtol=1e-5)
        out[f"T{T}"] = _diff(r["triton"][0], r["torch"][0])[0]
    # ties: experts 3j, 3j+1, 3j+2 identical in every router and in the bias
    with torch.no_grad():
        for rt in moe.routers:
            for j in range(0, E - 2, 3):
                rt.weight[j + 1].copy_(rt.weight[j])
                rt.weight[j + 2].copy_(rt.weight[j])
        b = moe.e_score_correction_bias
        for j in range(0, E - 2, 3):
            b[j + 1] = b[j + 2] = b[j]
    x = torch.randn(130, cfg.hidden_size, generator=g).to(device)
    r = _route_both(moe, x)
    logits = r["triton"][2]
    groups = [list(range(j, min(j + 3, E))) for j in range(0, E, 3)]
    for grp in groups:  # the ties are exact in the kernels' own logits (else this checks nothing)
        for e in grp[1:]:
            assert torch.equal(logits[:, e], logits[:, grp[0]]) and torch.equal(
                logits[:, E + e], logits[:, E + grp[0]]
            )
    ids_t, ids_r = r["triton"][1].long(), r["torch"][1].long()
    assert torch.equal(ids_t, ids_r)
    torch.testing.assert_close(r["triton"][0], r["torch"][0], atol=1e-6, rtol=1e-5)
    cut = 0
    for row in ids_t.tolist():  # the top-k boundary cuts a group of three: its lowest ids are taken
        for e in row:
            lower = [m for m in groups[e // 3] if m < e]
            assert all(m in row for m in lower), row
        last = groups[row[k - 1] // 3]
        cut += sum(m in row for m in last) < len(last)
    assert cut > 0
    out["ties_rows_cut"] = cut
    return out


def run_model(device: str = "cpu") -> dict:
    """End to end: logits with the layers on the kernels vs on torch (same twin backend, fp32 pool), and both
    vs the reference."""
    cfg, ref, model = _model(device)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, cfg.vocab_size, (140,), generator=g)
    ids[0] = cfg.bos_token_id
    outs = {}
    for impl in ("triton", "torch"):
        _set(impl)
        s = th.Session(
            model, cfg, torch.float32, num_pages=4, max_ctx=1024, slots=2, impl="torch", device=device
        )
        parts = [s.extend([0], [ids[:100]]), s.extend([0], [ids[100:137]])]
        parts += [s.decode([0], [int(ids[137 + t])]) for t in range(3)]
        outs[impl] = torch.cat(parts).float().cpu()
    want = ref.forward(ids).logits.float()
    rep = {"positions": int(outs["triton"].shape[0]), "logit_scale": float(want.abs().max())}
    for name, (a, b) in {"triton_vs_torch": (outs["triton"], outs["torch"]), "triton_vs_reference": (outs["triton"], want),
                         "torch_vs_reference": (outs["torch"], want)}.items():  # fmt: skip
        rep[name] = {"max_logit_diff": float((a - b).abs().max()),
                     "top1_equal": int((a.argmax(-1) == b.argmax(-1)).sum())}  # fmt: skip
    return rep


if __name__ == "__main__":
    mode = sys.argv[1]
    dev = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    print(json.dumps(run_pieces(dev) if mode == "pieces" else run_model(dev)))
