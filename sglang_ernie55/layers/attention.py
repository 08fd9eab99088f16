"""ERNIE-5.5 attention layers for SGLang: HCA and MLA-DSA, both through `RadixAttention`. The projections live
here; the cache, block compression and the attention itself live in the `ernie55` backend
(`sglang_ernie55.attention`), which takes the layer kind from the config and the layer's other inputs as the one
keyword `ernie_inputs` (`HCAInputs` / `MLAInputs`, sglang_ernie55.attention.interface). Heads (and HCA output
groups) shard over the attention TP group; the indexer is replicated, as in SGLang's DeepSeek-V3.2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.runtime_context import get_parallel
from torch import nn

from ..attention.interface import HCAInputs, MLAInputs, query_dtype
from ..configuration import LAYER_HCA, LAYER_MLA_DSA
from .impl import use_kernels
from .linear import InputProjections, linear_quant_config
from .rope import RopePositions, RopeTable, mla_softmax_scale

# RopeTable / RopePositions live in layers.rope; the model reaches them through this module too
__all__ = [
    "Compressor",
    "Ernie55HCAAttention",
    "Ernie55MLADSAAttention",
    "Indexer",
    "RopePositions",
    "RopeTable",
    "norm_fp32",
    "norm_rope_fp32",
    "rms_norm_fp32",
]

# Heads, HCA output groups and their projections shard over SGLang's attention-TP group (tp / attn_dp / attn_cp;
# the whole TP group without attention DP / CP), whose row-parallel outputs all-reduce over that group
# (`parallel_group="attn_tp"` with `_reduce_over_attn_tp`), as SGLang's DeepSeek V4 does.
ATTN_TP = "attn_tp"


def _reduce_over_attn_tp() -> bool:
    """`use_dp_attention_reduce` of the row-parallel outputs: SGLang's RowParallelLinear shards its weight over
    `parallel_group` but all-reduces over the whole TP group unless told otherwise, which under attention DP / CP
    at attention TP > 1 would sum other DP ranks' rows (and pair an IDLE rank's collective with a layer's).
    Without DP / CP the two groups are one (SGLang's attn_tp group is the TP group), and the flag stays off."""
    par = get_parallel()
    return par.attn_tp_size < par.tp_size


def _add_prefix(name: str, prefix: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _sharded_loader(dim: int):
    """weight_loader that takes this TP rank's slice of a full checkpoint tensor along `dim`."""

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        tp, rank = get_parallel().attn_tp_size, get_parallel().attn_tp_rank
        n = param.shape[dim]
        if loaded.shape[dim] != n * tp:
            raise ValueError(f"cannot shard {tuple(loaded.shape)} over {tp} ranks into {tuple(param.shape)}")
        param.data.copy_(loaded.narrow(dim, rank * n, n).to(param.dtype))

    return load


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim in fp32 torch (weight None: weightless); returns fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def norm_fp32(norm: RMSNorm, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SGLang RMSNorm computed in fp32 on an fp32 (or any) input; returns fp32, or
    `out_dtype` (one rounding of the fp32 result). Kernels: `kernels.norm.rms_norm` (one launch)."""
    return rms_norm_fp32(x, norm.weight, norm.variance_epsilon, out_dtype, norm)


def rms_norm_fp32(x: torch.Tensor, weight, eps: float, out_dtype: torch.dtype | None = None, norm=None):
    """fp32 RMSNorm of the last dim (weight None: weightless); see norm_fp32."""
    if use_kernels(x):
        from ..kernels.norm import rms_norm

        return rms_norm(x, weight, eps, out_dtype)
    y = norm.forward_native(x.float()) if norm is not None else rms_norm_torch(x, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def norm_rope_fp32(
    x: torch.Tensor,
    weight,
    eps: float,
    rp: RopePositions,
    rope: RopeTable,
    norm=None,
    out_dtype: torch.dtype | None = None,
):
    """fp32 RMSNorm of the last dim (weight None: weightless), then interleaved RoPE on its last rope dims at the
    forward's positions; returns a new tensor, fp32 or rounded once to `out_dtype`. Kernels: one launch
    (`kernels.norm.rms_norm(rope=)`, which rounds last); torch: the norm, then `RopeTable.tail_`."""
    if rp.cos is not None and use_kernels(x):
        from ..kernels.norm import rms_norm

        return rms_norm(x, weight, eps, out_dtype, rope=(rp.cos, rp.sin))
    y = rope.tail_(rms_norm_fp32(x, weight, eps, None, norm), rp)
    return y if out_dtype is None else y.to(out_dtype)


def bmm_rows(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[t, b] = a[t, b] @ w[b]: a [T, B, K], w [B, K, N] (any strides a batched GEMM reads), one dtype ->
    [T, B, N] contiguous. The batched GEMM reads a's rows where they are and writes its rows into the token-major
    buffer: einsum's form of it returns a [B, T, N] result, so that flattening it is one more copy."""
    if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):  # out= takes no autograd
        return torch.bmm(a.transpose(0, 1), w).transpose(0, 1).contiguous()
    out = a.new_empty(a.shape[0], w.shape[0], w.shape[2])
    torch.bmm(a.transpose(0, 1), w, out=out.transpose(0, 1))
    return out


def _rope_query(q: torch.Tensor, q_dtype: torch.dtype | None, rp) -> torch.Tensor:
    """A projection's fresh query rows for in-place RoPE: as they are where the attention rounds queries to
    their dtype and the kernel rotates them (it computes in fp32 and rounds once, so the rotated slice has the
    bits of an fp32 rotation cast after, and the rest is untouched: exact), else an fp32 copy."""
    return q if q.dtype == q_dtype and rp.cos is not None and q.stride(-1) == 1 else q.float()


class Compressor(nn.Module):
    """HCA block compressor: `ape` [ratio, D], `norm`; its `wkv_gate` (H -> [values D | scores D]) is served in
    the layer's `x_proj` (the checkpoint name `compressor.wkv_gate` stays)."""

    def __init__(self, config, rope: RopeTable):
        super().__init__()
        D = config.head_dim
        self.D, self.ratio, self.rope_dim, self.eps = (
            D,
            config.compress_ratio,
            config.qk_rope_head_dim,
            config.rms_norm_eps,
        )
        self.ape = nn.Parameter(torch.empty(self.ratio, D, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(D, eps=config.rms_norm_eps)
        self._rope = [rope]  # not a submodule: the table is owned by the model

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's RoPE inverse frequencies (the kernel path's cos / sin tables come from them)."""
        return self._rope[0].inv_freq

    def compress(self, rows: torch.Tensor, block_idx: torch.Tensor) -> torch.Tensor:
        """rows [nb, ratio, 2D] fp32 (the blocks' [values | scores]), block_idx [nb] -> entries [nb, D] fp32.

        Per channel softmax over the block of (score + ape[offset]), weighted sum of the values,
        RMSNorm, RoPE (interleaved) on the last dims at position ratio * block_idx."""
        c, s = rows[..., : self.D], rows[..., self.D :]
        w = torch.softmax(s + self.ape, dim=1)  # ape: fp32 [ratio, D] parameter
        e = rms_norm_torch((w * c).sum(1), self.norm.weight, self.eps)
        r = self.rope_dim
        return torch.cat([e[:, :-r], self._rope[0].interleaved(e[:, -r:], block_idx * self.ratio)], dim=-1)


class Ernie55HCAAttention(nn.Module):
    """Heavily compressed attention: one shared KV head (K = V), raw window + compressed blocks + sink."""

    def __init__(self, config, layer_id: int, rope: RopeTable, quant_config=None, prefix: str = ""):
        super().__init__()
        H, h, D, G = config.hidden_size, config.num_attention_heads, config.head_dim, config.o_groups
        tp = get_parallel().attn_tp_size  # attention TP (= --tp unless attention DP / CP)
        if h % tp or G % tp:
            raise ValueError(f"HCA: attention TP {tp} must divide num_attention_heads {h} and o_groups {G}")
        self.h, self.D, self.G, self.r = h // tp, D, G // tp, config.qk_rope_head_dim
        self.o_lora, self.eps = config.o_lora_rank, config.rms_norm_eps
        ql, ol = config.q_lora_rank, config.o_lora_rank
        lq = lambda i, o: linear_quant_config(quant_config, i, o)  # noqa: E731
        p = lambda n: _add_prefix(n, prefix)  # noqa: E731
        # wq_a, wkv and the compressor's wkv_gate all read x: one GEMM per FP8 decision
        self.x_proj = InputProjections(
            H, {"wq_a": ql, "wkv": D, "compressor.wkv_gate": 2 * D}, quant_config, prefix
        )
        self.q_norm = RMSNorm(ql, eps=config.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(
            ql, h * D, bias=False, quant_config=lq(ql, h * D // tp), parallel_group=ATTN_TP, prefix=p("wq_b")
        )
        self.kv_norm = RMSNorm(D, eps=config.rms_norm_eps)
        # Grouped einsum (not a plain GEMM): kept unquantized, FP8 checkpoints are dequantized on load.
        self.wo_a = ColumnParallelLinear(
            h // G * D, G * ol, bias=False, quant_config=None, parallel_group=ATTN_TP, prefix=p("wo_a")
        )
        self.wo_b = RowParallelLinear(
            G * ol,
            H,
            bias=False,
            quant_config=lq(G * ol // tp, H),
            parallel_group=ATTN_TP,
            use_dp_attention_reduce=_reduce_over_attn_tp(),
            prefix=p("wo_b"),
        )
        self.attn_sink = nn.Parameter(torch.empty(self.h, dtype=torch.float32), requires_grad=False)
        self.attn_sink.weight_loader = _sharded_loader(0)
        self.compressor = Compressor(config, rope)
        self.attn = RadixAttention(
            self.h, D, scaling=D**-0.5, num_kv_heads=1, layer_id=layer_id, v_head_dim=D, prefix=p("attn")
        )
        self._rope = [rope]

    def forward(self, x: torch.Tensor, positions, forward_batch) -> torch.Tensor:
        """positions: [T] or the forward's `RopePositions`."""
        T, rope = x.shape[0], self._rope[0]
        rp = rope.at(positions)
        q_a, kv_x, cs = self.x_proj(x)
        q = self.wq_b(norm_fp32(self.q_norm, q_a, x.dtype))[0].view(T, self.h, self.D)
        # weightless per-head norm, a new tensor: fp32, or rounded once to the dtype the attention rounds the
        # queries to (the same values, without an fp32 copy of [T, h, D] and a cast)
        q = norm_rope_fp32(q, None, self.eps, rp, rope, out_dtype=query_dtype(LAYER_HCA))
        kv = norm_rope_fp32(kv_x, self.kv_norm.weight, self.kv_norm.variance_epsilon, rp, rope, self.kv_norm)
        # cs: the compressor's [values | scores] rows, handed over as x_proj's column slice (the backend reads
        # them as fp32: no copy here)
        o = self.attn(q, kv, kv, forward_batch, ernie_inputs=HCAInputs(cs, self.compressor, self.attn_sink))
        o = o.view(T, self.h, self.D)
        wa = self.wo_a.weight.view(self.G, self.o_lora, self.h // self.G * self.D)
        # o (the backend's fresh output) rotated back in place: in fp32, or in bf16 when the backend returned
        # FlashMLA's bf16 rows and wo_a is bf16. Both give the same bf16 operand: RoPE computes in fp32 and rounds
        # once, and a bf16 o is exact in fp32; the bf16 form skips an fp32 copy and a cast.
        if o.dtype not in (torch.float32, wa.dtype):
            o = o.float()
        o = rope.tail_(o, rp, inverse=True)
        og = o.reshape(T, self.G, self.h // self.G * self.D)  # explicit sizes: T = 0 works
        # in the weight's dtype, fp32 accumulation (no fp32 copy of wo_a per step); fp32 weights: unchanged
        z = bmm_rows(og.to(wa.dtype), wa.transpose(1, 2)).view(T, self.G * self.o_lora)
        return self.wo_b(z.to(x.dtype))[0]


class Ernie55MLADSAAttention(nn.Module):
    """DeepSeek-V3.2 MLA + lightning indexer, absorbed form against the latent cache."""

    def __init__(self, config, layer_id: int, rope: RopeTable, quant_config=None, prefix: str = ""):
        super().__init__()
        H, h = config.hidden_size, config.num_attention_heads
        tp = get_parallel().attn_tp_size  # attention TP (= --tp unless attention DP / CP)
        if h % tp:
            raise ValueError(f"MLA-DSA: attention TP {tp} must divide num_attention_heads {h}")
        self.h, self.dn, self.dr, self.dv, self.r = (
            h // tp,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        )
        self.nI, self.dI, self.eps = config.index_n_heads, config.index_head_dim, config.rms_norm_eps
        ql = config.q_lora_rank
        lq = lambda i, o: linear_quant_config(quant_config, i, o)  # noqa: E731
        p = lambda n: _add_prefix(n, prefix)  # noqa: E731
        qk = self.dn + self.dr
        # q_a_proj, kv_a_proj_with_mqa and the indexer's wk and weights_proj all read x: one GEMM per FP8 decision
        # (weights_proj is BF16 in the checkpoint; kv_a_proj_with_mqa goes with it where 576 columns do not tile)
        self.x_proj = InputProjections(
            H,
            {
                "q_a_proj": ql,
                "kv_a_proj_with_mqa": self.r + self.dr,
                "indexer.wk": self.dI,
                "indexer.weights_proj": self.nI,
            },
            quant_config,
            prefix,
            never_fp8=("indexer.weights_proj",),
        )
        self.q_a_layernorm = RMSNorm(ql, eps=config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(
            ql,
            h * qk,
            bias=False,
            quant_config=lq(ql, h * qk // tp),
            parallel_group=ATTN_TP,
            prefix=p("q_b_proj"),
        )
        self.kv_a_layernorm = RMSNorm(self.r, eps=config.rms_norm_eps)
        # Absorbed into the query (W_uk) and the output (W_uv): kept unquantized, dequantized on load.
        self.kv_b_proj = ColumnParallelLinear(
            self.r,
            h * (self.dn + self.dv),
            bias=False,
            quant_config=None,
            parallel_group=ATTN_TP,
            prefix=p("kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(
            h * self.dv,
            H,
            bias=False,
            quant_config=lq(h * self.dv // tp, H),
            parallel_group=ATTN_TP,
            use_dp_attention_reduce=_reduce_over_attn_tp(),
            prefix=p("o_proj"),
        )
        self.indexer = Indexer(config, quant_config, p("indexer"))
        self.scale = mla_softmax_scale(qk, config.rope_scaling)
        self.attn = RadixAttention(
            self.h,
            self.r + self.dr,
            scaling=self.scale,
            num_kv_heads=1,
            layer_id=layer_id,
            v_head_dim=self.r,
            prefix=p("attn"),
        )
        self._rope = [rope]

    def forward(self, x: torch.Tensor, positions, forward_batch) -> torch.Tensor:
        """positions: [T] or the forward's `RopePositions`."""
        T, rope = x.shape[0], self._rope[0]
        rp = rope.at(positions)
        q_a, kv_a, ik_x, iw_x = self.x_proj(x)
        q_lat = norm_fp32(self.q_a_layernorm, q_a, x.dtype)
        qd = query_dtype(LAYER_MLA_DSA)  # as the HCA layer's queries
        q = _rope_query(self.q_b_proj(q_lat)[0].view(T, self.h, self.dn + self.dr), qd, rp)
        # the tail is rotated in place: fp32 (a new tensor), or a view of x_proj's fresh output
        kv_a = kv_a.float()
        latent = norm_fp32(self.kv_a_layernorm, kv_a[:, : self.r])
        q_pe = rope.rotated_tail(q, rp)  # kernels: rotated inside q (q_nope untouched)
        k_pe = rope.rotated_tail(kv_a, rp)  # after the latent's norm read kv_a[:, :r]
        # absorbed W_uk / W_uv in the weight's dtype, fp32 accumulation (no per-step fp32 copy of kv_b_proj)
        w = self.kv_b_proj.weight.view(self.h, self.dn + self.dv, self.r)
        iq, iw, ik = self.indexer(ik_x, iw_x, q_lat, rp, rope, qd)
        o_lat = self.attn(
            self._absorbed_query(q, q_pe, w, qd),
            torch.cat([latent, k_pe], -1),
            latent,
            forward_batch,
            ernie_inputs=MLAInputs(iq, iw, ik),
        )
        o = bmm_rows(o_lat.view(T, self.h, self.r).to(w.dtype), w[:, self.dn :].transpose(1, 2))
        return self.o_proj(o.view(T, self.h * self.dv).to(x.dtype))[0]

    def _absorbed_query(self, q, q_pe, w, qd: torch.dtype | None) -> torch.Tensor:
        """[q_nope W_uk | q_pe] [T, h, r + dr]: fp32 (qd None), else in qd. Where q and the weight are in qd
        already, the batched GEMM writes its rows into the query's buffer (one [T, h, r + dr] write, where a
        concatenation would read and write it again); else einsum and a concatenation."""
        q_nope, w_uk = q[..., : self.dn], w[:, : self.dn]
        if qd is None or q.dtype != qd or w.dtype != qd:
            q_abs = torch.einsum("thd,hdr->thr", q_nope.to(w.dtype), w_uk)
            return torch.cat([q_abs, q_pe], -1) if qd is None else torch.cat([q_abs.to(qd), q_pe.to(qd)], -1)
        out = q.new_empty(q.shape[0], self.h, self.r + self.dr)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=out[..., : self.r].transpose(0, 1))
        out[..., self.r :] = q_pe
        return out


class Indexer(nn.Module):
    """Lightning indexer (replicated over TP): wq_b (from the query latent), wk + LayerNorm, weights_proj; wk and
    weights_proj read x and are served in the layer's `x_proj` (their checkpoint names `indexer.wk`,
    `indexer.weights_proj` stay), so the indexer takes their outputs."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        ql = config.q_lora_rank
        self.n, self.d, self.dr = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
        lq = lambda i, o: linear_quant_config(quant_config, i, o)  # noqa: E731
        p = lambda n: _add_prefix(n, prefix)  # noqa: E731
        self.wq_b = ReplicatedLinear(
            ql, self.n * self.d, bias=False, quant_config=lq(ql, self.n * self.d), prefix=p("wq_b")
        )
        # fp32 parameters (loaded exactly from BF16 / FP32 checkpoints): the fp32 LayerNorm needs no per-step cast
        self.k_norm = nn.LayerNorm(self.d, eps=config.rms_norm_eps, dtype=torch.float32)

    def forward(
        self,
        k_x: torch.Tensor,
        w_x: torch.Tensor,
        q_lat: torch.Tensor,
        positions,
        rope: RopeTable,
        q_dtype: torch.dtype | None = None,
    ):
        """k_x [T, d], w_x [T, n]: the wk and weights_proj outputs. -> qI [T, n, d], w [T, n] (scaled by
        n^-0.5 d^-0.5), kI [T, d]; fp32 (qI: in `q_dtype` where `_rope_query` keeps it), RoPE (rotate-half) on
        the first dims. positions: [T] or the forward's `RopePositions`."""
        T = q_lat.shape[0]
        rp = rope.at(positions)
        q = rope.head_half_(_rope_query(self.wq_b(q_lat)[0].view(T, self.n, self.d), q_dtype, rp), rp)
        k = F.layer_norm(
            k_x.float(),
            (self.d,),
            self.k_norm.weight.float(),
            self.k_norm.bias.float(),
            self.k_norm.eps,
        )
        k = rope.head_half_(k, rp)
        w = w_x.float() * (self.n**-0.5 * self.d**-0.5)
        return q, w, k
