"""The ERNIE-5.5-Flash reference model: pure PyTorch, one device, written for reading; the oracle every kernel,
the SGLang model and the ECHO draft are compared to (docs/architecture-choices.md: where the spec was silent).

`forward(input_ids)` runs a whole sequence with explicit masks, `step(input_ids, cache)` extends any chunk
with explicit caches; both give the same logits. `state_dict()` keys are the checkpoint tensor names;
weights are stored in the module's dtype and every computation upcasts to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration import LAYER_HCA, Ernie55Config
from . import functional as Fn
from .mhc import HcParams, hc_head, hc_post, hc_pre
from .rope import apply_rope_half, apply_rope_interleaved, mla_softmax_scale, yarn_inv_freq

# raw parameters (no `.weight` suffix) that checkpoints keep in fp32
FP32_PARAMS = frozenset({"fn", "base", "scale", "attn_sink", "ape", "e_score_correction_bias"})

# ----------------------------------------------------------------------------- small helpers


def lin(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """fp32 matmul of x with an nn.Linear's weight (no bias anywhere in this model)."""
    return F.linear(x.float(), layer.weight.float())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.rms_norm(x, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class SwiGLU(nn.Module):
    """gate_proj / up_proj / down_proj (dense FFN, routed experts, shared expert)."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            _linear(dim, inter),
            _linear(dim, inter),
            _linear(inter, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fn.swiglu(
            x.float(),
            self.gate_proj.weight.float(),
            self.up_proj.weight.float(),
            self.down_proj.weight.float(),
        )


# ----------------------------------------------------------------------------- caches


@dataclass
class HCACache:
    """Per HCA layer: the raw window (last `window_size` roped kv with positions), the compressed entries
    of all complete blocks, and the open block's per-channel online-softmax state (max m, sum l, acc)."""

    kv: torch.Tensor | None = None  # [<=W, D]
    pos: torch.Tensor | None = None  # [<=W]
    cmp: torch.Tensor | None = None  # [n_blocks, D]
    m: torch.Tensor | None = None  # [D]
    l: torch.Tensor | None = None  # [D]
    acc: torch.Tensor | None = None  # [D]


@dataclass
class MLACache:
    """Per MLA-DSA layer: every token's normed latent, roped k_pe and indexer key."""

    latent: torch.Tensor | None = None  # [S, kv_lora_rank]
    k_pe: torch.Tensor | None = None  # [S, rope]
    k_idx: torch.Tensor | None = None  # [S, index_head_dim]
    pos: torch.Tensor | None = None  # [S]


@dataclass
class Ernie55Cache:
    layers: list = field(default_factory=list)
    next_pos: int = 0


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], 0)


# ----------------------------------------------------------------------------- MoE


class LatentMoE(nn.Module):
    """Multi-router latent MoE: routers score in H, experts run in the `moe_latent_size` latent."""

    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        H, E = cfg.hidden_size, cfg.n_routed_experts
        self.routers = nn.ModuleList(_linear(H, E) for _ in range(cfg.num_routers))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))
        self.latent_down = _linear(H, cfg.moe_latent_size)
        self.latent_up = _linear(cfg.moe_latent_size, H)
        self.experts = nn.ModuleList(SwiGLU(cfg.moe_latent_size, cfg.moe_intermediate_size) for _ in range(E))
        self.shared_experts = SwiGLU(H, cfg.shared_expert_intermediate_size) if cfg.n_shared_experts else None
        self.topk, self.norm_topk_prob, self.scaling = (
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return Fn.multi_router_topk(
            x,
            [r.weight for r in self.routers],
            self.e_score_correction_bias,
            self.topk,
            self.norm_topk_prob,
            self.scaling,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(x)
        z = lin(x, self.latent_down)
        acc = torch.zeros_like(z)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            acc.index_add_(0, tok, w[tok, slot, None] * self.experts[e](z[tok]))
        y = lin(acc, self.latent_up)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


# ----------------------------------------------------------------------------- HCA


class Compressor(nn.Module):
    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        D = cfg.head_dim
        self.wkv_gate = _linear(cfg.hidden_size, 2 * D)
        self.ape = nn.Parameter(torch.zeros(cfg.compress_ratio, D, dtype=torch.float32))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)


class HCAAttention(nn.Module):
    """Heavily compressed attention (one shared KV head, K = V): raw window + compressed blocks + sink."""

    def __init__(self, cfg: Ernie55Config, inv_freq: torch.Tensor):
        super().__init__()
        H, h, D, G = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.h, self.D, self.G, self.rope = h, D, G, cfg.qk_rope_head_dim
        self.W, self.ratio, self.eps = cfg.window_size, cfg.compress_ratio, cfg.rms_norm_eps
        self.wq_a = _linear(H, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, h * D)
        self.wkv = _linear(H, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = _linear(h // G * D, G * cfg.o_lora_rank)
        self.wo_b = _linear(G * cfg.o_lora_rank, H)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = Compressor(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[..., -self.rope :] = apply_rope_interleaved(x[..., -self.rope :], pos, self.inv_freq)
        return x

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """q [T,h,D] (per-head RMSNorm, roped), kv [T,D] (normed, roped), compressor values/scores [T,D]."""
        q = lin(self.q_norm(lin(x, self.wq_a)), self.wq_b).view(-1, self.h, self.D)
        q = self._rope(Fn.rms_norm(q, None, self.eps), pos)
        kv = self._rope(self.kv_norm(lin(x, self.wkv)), pos)
        cs = lin(x, self.compressor.wkv_gate)
        return q, kv, cs[:, : self.D], cs[:, self.D :]

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return Fn.hca_output(o, pos, self.inv_freq, self.rope, self.wo_a.weight, self.wo_b.weight, self.G)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, window_only: bool = False) -> torch.Tensor:
        """Whole sequence starting at position 0."""
        q, kv, c, s = self.project(x, pos)
        cmp = Fn.hca_compress(
            c, s, self.compressor.ape, self.compressor.norm.weight, self.eps, self.inv_freq, self.rope
        )
        raw_mask, cmp_mask = Fn.hca_visible_mask(pos, pos, cmp.shape[0], self.W, self.ratio)
        if window_only:
            keys, mask = kv, raw_mask
        else:
            keys, mask = torch.cat([kv, cmp]), torch.cat([raw_mask, cmp_mask], dim=1)
        o = Fn.sink_attention(q, keys, mask, self.attn_sink, self.D**-0.5)
        return self.output(o, pos)

    def step(
        self, x: torch.Tensor, pos: torch.Tensor, cache: HCACache, window_only: bool = False
    ) -> torch.Tensor:
        """Extend by a chunk of consecutive positions, reading and updating `cache`."""
        q, kv, c, s = self.project(x, pos)
        ape, new_cmp = self.compressor.ape.float(), []
        for t in range(x.shape[0]):  # open-block state: per-channel online softmax over the block
            off = int(pos[t]) % self.ratio
            z = s[t] + ape[off]
            if off == 0:
                cache.m, cache.l, cache.acc = z, torch.ones_like(z), c[t].clone()
            else:
                m_new = torch.maximum(cache.m, z)
                a, b = torch.exp(cache.m - m_new), torch.exp(z - m_new)
                cache.m, cache.l, cache.acc = m_new, cache.l * a + b, cache.acc * a + c[t] * b
            if off == self.ratio - 1:
                e = Fn.rms_norm(cache.acc / cache.l, self.compressor.norm.weight, self.eps)
                new_cmp.append(self._rope(e[None], pos[t : t + 1] - off)[0])
        if new_cmp:
            cache.cmp = _cat(cache.cmp, torch.stack(new_cmp))
        keys, kpos = _cat(cache.kv, kv), _cat(cache.pos, pos)
        n_cmp = 0 if cache.cmp is None else cache.cmp.shape[0]
        raw_mask, cmp_mask = Fn.hca_visible_mask(pos, kpos, n_cmp, self.W, self.ratio)
        if window_only or n_cmp == 0:
            all_keys, mask = keys, raw_mask
        else:
            all_keys, mask = torch.cat([keys, cache.cmp]), torch.cat([raw_mask, cmp_mask], dim=1)
        o = Fn.sink_attention(q, all_keys, mask, self.attn_sink, self.D**-0.5)
        cache.kv, cache.pos = keys[-self.W :], kpos[-self.W :]
        return self.output(o, pos)


# ----------------------------------------------------------------------------- MLA-DSA


class Indexer(nn.Module):
    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        self.n, self.d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = _linear(cfg.q_lora_rank, self.n * self.d)
        self.wk = _linear(cfg.hidden_size, self.d)
        self.k_norm = nn.LayerNorm(self.d, eps=cfg.rms_norm_eps)
        self.weights_proj = _linear(cfg.hidden_size, self.n)


class MLADSAAttention(nn.Module):
    """DeepSeek-V3.2 MLA with the lightning indexer choosing `index_topk` keys per query."""

    def __init__(self, cfg: Ernie55Config, inv_freq: torch.Tensor):
        super().__init__()
        H, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.dn, self.dr, self.dv, self.r = (
            h,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        self.topk, self.W = cfg.index_topk, cfg.window_size
        self.scale = mla_softmax_scale(cfg.qk_head_dim, cfg.rope_scaling)
        self.q_a_proj = _linear(H, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, h * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = _linear(H, self.r + self.dr)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps)
        self.kv_b_proj = _linear(self.r, h * (self.dn + self.dv))
        self.o_proj = _linear(h * self.dv, H)
        self.indexer = Indexer(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        q_lat = self.q_a_layernorm(lin(x, self.q_a_proj))
        q = lin(q_lat, self.q_b_proj).view(-1, self.h, self.dn + self.dr)
        q_nope, q_pe = q[..., : self.dn], apply_rope_interleaved(q[..., self.dn :], pos, self.inv_freq)
        kv_a = lin(x, self.kv_a_proj_with_mqa)
        latent = self.kv_a_layernorm(kv_a[:, : self.r])
        k_pe = apply_rope_interleaved(kv_a[:, self.r :], pos, self.inv_freq)
        ix = self.indexer
        q_idx = lin(q_lat, ix.wq_b).view(-1, ix.n, ix.d)
        k_idx = F.layer_norm(
            lin(x, ix.wk), (ix.d,), ix.k_norm.weight.float(), ix.k_norm.bias.float(), ix.k_norm.eps
        )
        q_idx = torch.cat(
            [apply_rope_half(q_idx[..., : self.dr], pos, self.inv_freq), q_idx[..., self.dr :]], -1
        )
        k_idx = torch.cat(
            [apply_rope_half(k_idx[..., : self.dr], pos, self.inv_freq), k_idx[..., self.dr :]], -1
        )
        w_idx = lin(x, ix.weights_proj) * (ix.n**-0.5 * ix.d**-0.5)
        return q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx

    def _mask(self, q_idx, w_idx, k_idx, qpos, kpos, window_only: bool) -> torch.Tensor:
        if window_only:  # ECHO: plain MLA over the window
            d = qpos[:, None] - kpos[None, :]
            return (d >= 0) & (d < self.W)
        return Fn.indexer_topk(Fn.indexer_scores(q_idx, w_idx, k_idx), qpos, kpos, self.topk)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, window_only: bool = False) -> torch.Tensor:
        """Whole sequence, expanded form (per-head keys and values from kv_b_proj)."""
        q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx = self.project(x, pos)
        kv = lin(latent, self.kv_b_proj).view(-1, self.h, self.dn + self.dv)
        mask = self._mask(q_idx, w_idx, k_idx, pos, pos, window_only)
        o = Fn.mla_attention(q_nope, q_pe, kv[..., : self.dn], k_pe, kv[..., self.dn :], mask, self.scale)
        return lin(o.flatten(1), self.o_proj)

    def step(
        self, x: torch.Tensor, pos: torch.Tensor, cache: MLACache, window_only: bool = False
    ) -> torch.Tensor:
        """Extend by a chunk, absorbed form (KV per token = latent + k_pe), reading and updating `cache`."""
        q_nope, q_pe, latent, k_pe, q_idx, k_idx, w_idx = self.project(x, pos)
        cache.latent, cache.k_pe = _cat(cache.latent, latent), _cat(cache.k_pe, k_pe)
        cache.k_idx, cache.pos = _cat(cache.k_idx, k_idx), _cat(cache.pos, pos)
        mask = self._mask(q_idx, w_idx, cache.k_idx, pos, cache.pos, window_only)
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)
        o = Fn.mla_attention_absorbed(
            q_nope, q_pe, cache.latent, cache.k_pe, w[:, : self.dn], w[:, self.dn :], mask, self.scale
        )
        return lin(o.flatten(1), self.o_proj)


# ----------------------------------------------------------------------------- decoder layer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Ernie55Config, layer_id: int, inv_freq: torch.Tensor):
        super().__init__()
        n, H = cfg.hc_mult, cfg.hidden_size
        self.kind = cfg.layer_types[layer_id]
        self.hc_kw = dict(hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters, rms_eps=cfg.rms_norm_eps)
        self.attn_hc = HcParams((2 + n) * n, n, H, 3)
        self.ffn_hc = HcParams((2 + n) * n, n, H, 3)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        attn_cls = HCAAttention if self.kind == LAYER_HCA else MLADSAAttention
        self.self_attn = attn_cls(cfg, inv_freq)
        self.mlp = LatentMoE(cfg) if cfg.is_moe_layer(layer_id) else SwiGLU(H, cfg.intermediate_size)

    def new_cache(self):
        return HCACache() if self.kind == LAYER_HCA else MLACache()

    def forward(
        self, R: torch.Tensor, pos: torch.Tensor, cache=None, window_only: bool = False
    ) -> torch.Tensor:
        """R [T, n, H] -> R' [T, n, H] (fp32). With `cache`, runs the incremental path."""
        hc = self.attn_hc
        y, post, C = hc_pre(R, hc.fn, hc.base, hc.scale, **self.hc_kw)
        y = self.input_layernorm(y)
        a = (
            self.self_attn(y, pos, window_only)
            if cache is None
            else self.self_attn.step(y, pos, cache, window_only)
        )
        R = hc_post(a, R, post, C)
        hc = self.ffn_hc
        y, post, C = hc_pre(R, hc.fn, hc.base, hc.scale, **self.hc_kw)
        return hc_post(self.mlp(self.post_attention_layernorm(y)), R, post, C)


# ----------------------------------------------------------------------------- model


class Ernie55Model(nn.Module):
    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        inv_freq = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, inv_freq) for i in range(cfg.num_hidden_layers))
        self.hc_head = HcParams(cfg.hc_mult, cfg.hc_mult, cfg.hidden_size, 1)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Echo(nn.Module):
    """ECHO draft's own tensors; the decoder layer is the backbone's last layer (the same module)."""

    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        H = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        self.e_proj, self.h_proj = _linear(H, H), _linear(H, H)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)


@dataclass
class RefOutput:
    logits: torch.Tensor  # [T, V] fp32
    streams: torch.Tensor  # [T, n, H] fp32: the last residual streams before hc_head (ECHO's input)
    layer_rms: list[float] = field(default_factory=list)  # RMS of the streams after each layer


class Ernie55ReferenceModel(nn.Module):
    def __init__(self, cfg: Ernie55Config):
        super().__init__()
        self.config = cfg
        self.model = Ernie55Model(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.echo = Echo(cfg) if cfg.num_nextn_predict_layers else None

    # -- shared pieces ---------------------------------------------------------------------------
    def _embed_streams(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens.weight[ids].float()
        return h[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def head(self, R: torch.Tensor, final_norm: RMSNorm | None = None) -> torch.Tensor:
        """hc_head -> final norm (model.norm, or echo.norm for the draft) -> lm_head; fp32 logits."""
        hc, cfg = self.model.hc_head, self.config
        y = hc_head(R, hc.fn, hc.base, hc.scale, hc_eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps)
        return lin((final_norm or self.model.norm)(y), self.lm_head)

    # -- whole sequence ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, return_layer_rms: bool = False) -> RefOutput:
        """input_ids [T] (one sequence, positions 0..T-1)."""
        pos = torch.arange(input_ids.shape[0], device=input_ids.device)
        R, rms = self._embed_streams(input_ids), []
        for layer in self.model.layers:
            R = layer(R, pos)
            if return_layer_rms:
                rms.append(R.pow(2).mean().sqrt().item())
        return RefOutput(self.head(R), R, rms)

    # -- incremental ---------------------------------------------------------------------------
    def new_cache(self) -> Ernie55Cache:
        return Ernie55Cache([layer.new_cache() for layer in self.model.layers])

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: Ernie55Cache) -> RefOutput:
        """Extend the cached sequence by input_ids [t] (t >= 1; t == 1 is decode)."""
        pos = torch.arange(cache.next_pos, cache.next_pos + input_ids.shape[0], device=input_ids.device)
        R = self._embed_streams(input_ids)
        for layer, lc in zip(self.model.layers, cache.layers):
            R = layer(R, pos, cache=lc)
        cache.next_pos += input_ids.shape[0]
        return RefOutput(self.head(R), R)

    @torch.no_grad()
    def generate_greedy(
        self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None = None
    ) -> list[int]:
        """Greedy continuation through the incremental path (ties: lowest token id, like argmax)."""
        cache, out = self.new_cache(), []
        logits = self.step(prompt_ids, cache).logits[-1]
        for _ in range(max_new_tokens):
            tok = int(torch.argmax(logits))
            out.append(tok)
            if eos_id is not None and tok == eos_id:
                break
            logits = self.step(torch.tensor([tok], device=prompt_ids.device), cache).logits[-1]
        return out

    # -- ECHO draft ---------------------------------------------------------------------------
    def echo_inputs(self, streams: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """R0[i] = e_proj(enorm(embed(next_token_i))) + h_proj(hnorm(streams[i]))  -> [T, n, H]."""
        e = self.echo
        emb = lin(e.enorm(self.model.embed_tokens.weight[next_tokens]), e.e_proj)
        return emb[:, None, :] + lin(e.hnorm(streams), e.h_proj)

    @torch.no_grad()
    def echo_forward(
        self,
        streams: torch.Tensor,
        next_tokens: torch.Tensor,
        cache: HCACache | MLACache | None = None,
        start_pos: int = 0,
    ) -> RefOutput:
        """ECHO draft. Entry i combines target stream i with token i+1 (`next_tokens[i]`) and sits at
        position start_pos + i. The backbone's last layer (same weights) attends over the window only.
        Without `cache`: a whole sequence from position 0; with it: incremental (the draft's own KV).
        Returns the draft logits and the draft's pre-hc_head streams (fed back for chained steps)."""
        assert self.echo is not None, "this config has no ECHO layer (num_nextn_predict_layers = 0)"
        last = self.model.layers[-1]
        pos = torch.arange(start_pos, start_pos + next_tokens.shape[0], device=next_tokens.device)
        R = last(self.echo_inputs(streams, next_tokens), pos, cache=cache, window_only=True)
        return RefOutput(self.head(R, self.echo.norm), R)

    def new_echo_cache(self):
        return self.model.layers[-1].new_cache()

    # -- random init ---------------------------------------------------------------------------
    @torch.no_grad()
    def init_random_(self, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Ernie55ReferenceModel:
        """Fresh random weights whose activations stay O(1) through every layer (tested).

        Linear weights ~ N(0, 1/fan_in) (so each projection preserves RMS), stored in `dtype`; norm
        weights ~ 1 + N(0, 0.1); embeddings ~ N(0, 1). mHC fn ~ N(0, 0.5/sqrt(nH)) with base/scale near
        identity (pre ~ 0.5, post ~ 1, C ~ doubly stochastic), so the streams stay O(1); router bias and
        sink are small non-zero values so that every feature is exercised.
        """
        g = torch.Generator().manual_seed(seed)

        def randn(*shape, std=1.0):
            return torch.randn(*shape, generator=g) * std

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                p.copy_(randn(*p.shape))
            elif p.dim() == 2 and leaf == "weight":  # Linear
                p.copy_(randn(*p.shape, std=p.shape[1] ** -0.5))
            elif leaf == "bias" or name.endswith("e_score_correction_bias"):
                p.copy_(randn(*p.shape, std=0.05))
            elif leaf == "weight":  # 1-D norm weights
                p.copy_(1.0 + randn(*p.shape, std=0.1))
            elif leaf == "fn":
                p.copy_(randn(*p.shape, std=0.5 * p.shape[1] ** -0.5))
            elif leaf == "base":
                p.copy_(randn(*p.shape, std=0.1))
            elif leaf == "scale":
                p.copy_(1.0 + randn(*p.shape, std=0.1))
            elif leaf == "attn_sink":
                p.copy_(randn(*p.shape, std=0.5))
            elif leaf == "ape":
                p.copy_(randn(*p.shape, std=0.5))
            else:
                raise KeyError(f"init_random_: no rule for parameter {name}")
        return self.to_dtype_(dtype)

    def to_dtype_(self, dtype: torch.dtype) -> Ernie55ReferenceModel:
        """Store weights in `dtype` (the checkpoint dtype); raw params that the spec keeps in fp32 (hc
        params, attn_sink, ape, e_score_correction_bias) stay fp32."""
        for name, p in self.named_parameters():
            if name.rsplit(".", 1)[-1] not in FP32_PARAMS:
                p.data = p.data.to(dtype)
        return self


def build_reference(
    cfg: Ernie55Config, seed: int | None = 0, dtype: torch.dtype = torch.bfloat16
) -> Ernie55ReferenceModel:
    """A reference model with random weights (seed) or uninitialised (seed=None, to load a checkpoint)."""
    with torch.device("cpu"):
        model = Ernie55ReferenceModel(cfg)
    if seed is not None:
        model.init_random_(seed, dtype)
    return model


__all__ = [
    "Ernie55ReferenceModel",
    "Ernie55Cache",
    "HCACache",
    "MLACache",
    "RefOutput",
    "build_reference",
    "FP32_PARAMS",
]
