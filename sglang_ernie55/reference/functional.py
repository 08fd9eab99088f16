"""Stateless math of ERNIE-5.5 in plain PyTorch: the one reference that model, kernels and benchmarks share.

Every function computes in fp32 and returns fp32 unless it says otherwise. Shapes: T = query tokens,
S = key tokens, h = heads, D = head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rope import apply_rope_interleaved

# ----------------------------------------------------------------------------- norms, FFN


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x); weights in nn.Linear layout [out, in]. No clamp."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# ----------------------------------------------------------------------------- HCA


def hca_compress_block(
    c: torch.Tensor,
    s: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    block_index: int,
    inv_freq: torch.Tensor,
    rope_dim: int,
) -> torch.Tensor:
    """One compressed entry from one complete block.

    c, s [ratio, D] (values, scores; fp32), ape [ratio, D]. Per channel:
    cmp = sum_t softmax_t(s_t + ape_t) * c_t; RMSNorm(norm_w); RoPE (interleaved) on the last `rope_dim`
    dims at position ratio * block_index. Returns [D] fp32.
    """
    ratio = c.shape[0]
    w = torch.softmax(s.float() + ape.float(), dim=0)
    cmp = rms_norm((w * c.float()).sum(0), norm_w, eps)
    pos = torch.tensor([ratio * block_index], device=c.device)
    cmp[-rope_dim:] = apply_rope_interleaved(cmp[None, -rope_dim:], pos, inv_freq)[0]
    return cmp


def hca_compress(
    c: torch.Tensor,
    s: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rope_dim: int,
) -> torch.Tensor:
    """All complete blocks of a sequence that starts at position 0. c, s [T, D] -> [T // ratio, D]."""
    ratio = ape.shape[0]
    nb = c.shape[0] // ratio
    out = [
        hca_compress_block(
            c[j * ratio : (j + 1) * ratio],
            s[j * ratio : (j + 1) * ratio],
            ape,
            norm_w,
            eps,
            j,
            inv_freq,
            rope_dim,
        )
        for j in range(nb)
    ]
    return torch.stack(out) if out else c.new_zeros(0, c.shape[1], dtype=torch.float32)


def hca_visible_mask(
    q_pos: torch.Tensor, kv_pos: torch.Tensor, n_cmp: int, window: int, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks [T, S] over raw keys (p-W < s <= p) and [T, n_cmp] over compressed entries (j < (p+1)//ratio)."""
    d = q_pos[:, None] - kv_pos[None, :]
    raw = (d >= 0) & (d < window)
    j = torch.arange(n_cmp, device=q_pos.device)
    cmp = j[None, :] < ((q_pos + 1) // ratio)[:, None]
    return raw, cmp


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """MQA with K = V and an optional per-head sink logit.

    q [T, h, D], kv [S, D], mask [T, S] bool (True = attend), sink [h] raw logit (not scaled; adds
    exp(sink) to the denominator only). o_h = sum_k exp(q.k*scale) v_k / (sum_k exp(q.k*scale) + exp(sink_h)).
    Returns [T, h, D] fp32. A query with no visible key and no sink returns 0.
    """
    logits = torch.einsum("thd,sd->ths", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    if sink is not None:
        sink_col = sink.float()[None, :, None].expand(logits.shape[0], -1, 1)
        logits = torch.cat([logits, sink_col], dim=-1)
    mx = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(logits - mx)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    if sink is not None:
        p = p[..., :-1]
    return torch.einsum("ths,sd->thd", p, kv.float())


def hca_output(
    o: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_dim: int,
    wo_a: torch.Tensor,
    wo_b: torch.Tensor,
    groups: int,
) -> torch.Tensor:
    """Inverse RoPE on o[..., -rope:], grouped wo_a (row-blocked by group), group-major concat, wo_b.

    o [T, h, D]; wo_a [G*o_lora, h/G*D]; wo_b [H, G*o_lora]. Returns [T, H] (fp32 math, wo dtype in)."""
    T, h, D = o.shape
    o = o.clone()
    o[..., -rope_dim:] = apply_rope_interleaved(o[..., -rope_dim:], q_pos, inv_freq, inverse=True)
    og = o.reshape(T, groups, (h // groups) * D)
    wa = wo_a.float().view(groups, -1, og.shape[-1])  # [G, o_lora, h/G*D]
    z = torch.einsum("tgk,grk->tgr", og, wa).reshape(T, -1)
    return z @ wo_b.float().t()


# ----------------------------------------------------------------------------- MLA-DSA


def indexer_scores(qI: torch.Tensor, w: torch.Tensor, kI: torch.Tensor) -> torch.Tensor:
    """I(t, s) = sum_h w[t,h] * ReLU(qI[t,h] . kI[s]). qI [T, nI, dI], w [T, nI], kI [S, dI] -> [T, S] fp32."""
    return torch.einsum(
        "th,ths->ts", w.float(), torch.relu(torch.einsum("thd,sd->ths", qI.float(), kI.float()))
    )


def indexer_topk(scores: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Mask [T, S] of the selected keys: the `topk` causal (k_pos <= q_pos) keys with the largest score,
    ties to the earlier position; all causal keys when there are <= topk of them."""
    causal = k_pos[None, :] <= q_pos[:, None]
    masked = scores.float().masked_fill(~causal, float("-inf"))
    # stable descending sort keeps ties in key order, i.e. earlier positions first (keys sorted by position)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    sel = torch.zeros_like(causal)
    sel.scatter_(1, order, True)
    return sel & causal


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Expanded MLA. q_nope [T,h,dn], q_pe [T,h,dr], k_nope [S,h,dn], k_pe [S,dr] (shared), v [S,h,dv],
    mask [T,S]. Returns [T, h, dv] fp32."""
    logits = torch.einsum("thd,shd->ths", q_nope.float(), k_nope.float())
    logits = (logits + torch.einsum("thd,sd->ths", q_pe.float(), k_pe.float())) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("ths,shd->thd", torch.softmax(logits, -1), v.float())


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA (decode form): q_nope absorbed into the latent; KV per token = latent + k_pe.

    latent [S, r], k_pe [S, dr], w_uk [h, dn, r], w_uv [h, dv, r]. Returns [T, h, dv] fp32."""
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())
    logits = torch.einsum("thr,sr->ths", q_lat, latent.float())
    logits = (logits + torch.einsum("thd,sd->ths", q_pe.float(), k_pe.float())) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    o_lat = torch.einsum("ths,sr->thr", torch.softmax(logits, -1), latent.float())
    return torch.einsum("thr,hdr->thd", o_lat, w_uv.float())


# ----------------------------------------------------------------------------- MoE routing


def multi_router_topk(
    x: torch.Tensor,
    routers: list[torch.Tensor],
    bias: torch.Tensor,
    topk: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = mean_r sigmoid(x @ router_r^T) (fp32); idx = topk(s + bias) (ties: lower expert id);
    w = s[idx] / (sum + 1e-20) (if norm_topk_prob) * scaling. Returns (weights [T,k] fp32, ids [T,k] int64)."""
    xf = x.float()
    s = torch.stack([torch.sigmoid(xf @ r.float().t()) for r in routers]).mean(0)
    idx = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :topk]
    w = s.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, idx
