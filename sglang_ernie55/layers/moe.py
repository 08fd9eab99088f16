"""ERNIE-5.5 FFNs for SGLang: the dense SwiGLU of layer 0 and the multi-router latent MoE, whose routed
experts run in the `moe_latent_size` latent through SGLang's `FusedMoE` (Triton runner) and whose shared
expert runs at full width. Routing is ours (no in-tree `TopK` mode matches), handed to FusedMoE as a
`StandardTopKOutput`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.moe import get_moe_a2a_backend
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.moe.utils import post_experts_output_is_complete, sum_post_experts_output
from sglang.srt.runtime_context import get_parallel
from torch import nn

from ..configuration import checkpoint_config
from ..profiling import forward_range
from .impl import use_kernels
from .linear import FP8_BLOCK, linear_quant_config


def _p(name: str, prefix: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of gu = [g | u] (last dim): SGLang's fused `SiluAndMul` kernel on CUDA (one launch, fp32 math,
    one rounding), its native torch form elsewhere (a CPU server computes fp32, where the two agree)."""
    d = gu.shape[-1] // 2
    if gu.is_cuda:
        from sgl_kernel import silu_and_mul as fused

        out = torch.empty(gu.shape[:-1] + (d,), dtype=gu.dtype, device=gu.device)
        # no rows (an idle rank's step): the kernel would launch an empty grid, an invalid launch that the next
        # checked CUDA call reports
        if out.numel():
            fused(gu, out)
        return out
    return F.silu(gu[..., :d]) * gu[..., d:]


class Ernie55SwiGLU(nn.Module):
    """down(silu(gate x) * up x), gate and up merged into one column-parallel Linear (`gate_up_proj`: one GEMM,
    one FP8 activation quantisation; the checkpoint keeps `gate_proj` / `up_proj`), down row-parallel (dense
    FFN, shared expert)."""

    def __init__(self, hidden: int, inter: int, quant_config, prefix: str, reduce_results: bool = True):
        super().__init__()
        tp = get_parallel().tp_size
        lq = lambda i, o: linear_quant_config(quant_config, i, o)  # noqa: E731
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden,
            [inter, inter],
            bias=False,
            quant_config=lq(hidden, inter // tp),
            prefix=_p("gate_up_proj", prefix),
        )
        # the checkpoint's names of the two shards (the model's loader maps them here)
        self.gate_up_proj.ernie_parts = (_p("gate_proj", prefix), _p("up_proj", prefix))
        self.down_proj = RowParallelLinear(
            inter,
            hidden,
            bias=False,
            quant_config=lq(inter // tp, hidden),
            reduce_results=reduce_results,
            prefix=_p("down_proj", prefix),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)[0]))[0]


# Routing: s = mean_r sigmoid(x R_r^T) (fp32); ids = top-k(s + bias) (ties to the lower expert id);
# w = s[ids] / (sum + 1e-20) * routed_scaling_factor. On the kernels: one GEMM with fp32 products and sums
# (`kernels.router.router_logits`) against the routers concatenated once into one [R*E, H] matrix in their
# own dtype (`router_matrix`; the routers' parameters become views of it, so an in-place weight update
# reaches it) and `kernels.router.multi_router_topk`; on torch, the same rule in torch ops (a stable sort of
# all E experts).
class Ernie55LatentMoE(nn.Module):
    def __init__(self, config, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        H, E, L = config.hidden_size, config.n_routed_experts, config.moe_latent_size
        self.topk, self.norm_topk_prob, self.scaling = (
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        self.routers = nn.ModuleList(
            ReplicatedLinear(H, E, bias=False, quant_config=None, prefix=_p(f"routers.{r}", prefix))
            for r in range(config.num_routers)
        )
        self.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)
        self._router_cat: torch.Tensor | None = (
            None  # router_matrix(): not a buffer (the routers are its views)
        )
        self._router_ptrs: list = []
        lq = lambda i, o: linear_quant_config(quant_config, i, o)  # noqa: E731
        self.latent_down = ReplicatedLinear(
            H, L, bias=False, quant_config=lq(H, L), prefix=_p("latent_down", prefix)
        )
        self.latent_up = ReplicatedLinear(
            L, H, bias=False, quant_config=lq(L, H), prefix=_p("latent_up", prefix)
        )
        inter = config.moe_intermediate_size
        # Where the MoE output's sums over ranks happen (FusedMoE returns each rank's partial sum; SGLang 0.5.23
        # leaves that sum to the model, reduce_results=False). With SGLang's standard dispatch (no all-to-all)
        # every rank holds every token; each computes its experts' share (EP: its E/ep experts, MoE-TP: its slice
        # of each), and with moe_dp_size 1 the EP x MoE-TP ranks are the TP group. Then the routed partial,
        # projected up (latent_up is linear, so up(sum) = sum(up)) plus the shared expert's TP partial, is one
        # all-reduce over the TP group, as SGLang's latent MoE does (nemotron_h: fc2_latent_proj on the partial
        # sum, shared added, one reduction). Otherwise (an all-to-all backend, MoE-DP, or a dispatch whose
        # combine already summed): SGLang's sum_post_experts_output owes or skips the routed sums, and the
        # shared expert reduces its own output.
        par = get_parallel()
        self.one_reduce = (
            par.tp_size > 1
            and par.moe_dp_size == 1
            and get_moe_a2a_backend().is_none()
            and not post_experts_output_is_complete(is_tp_path=True)
        )
        # FP8 experts only where the checkpoint's own 128x128 blocks tile them: decided on config.json's width,
        # not on the width SGLang's CPU runner may have padded `inter` to (those get dequantized on load)
        stored = checkpoint_config(config).moe_intermediate_size
        self.experts_quantized = quant_config is not None and stored % FP8_BLOCK == 0 and L % FP8_BLOCK == 0
        self.experts = FusedMoE(
            num_experts=E,
            top_k=self.topk,
            layer_id=layer_id,
            hidden_size=L,
            intermediate_size=inter,
            quant_config=quant_config if self.experts_quantized else None,
            prefix=_p("experts", prefix),
        )
        self.shared_experts = (
            Ernie55SwiGLU(
                H,
                config.shared_expert_intermediate_size,
                quant_config,
                _p("shared_experts", prefix),
                reduce_results=not self.one_reduce,
            )
            if config.n_shared_experts
            else None
        )

    def router_matrix(self) -> torch.Tensor:
        """The routers as one [R*E, H] matrix in their dtype, built once (after weight loading, or at the
        first kernel call) and rebuilt only if a router's storage was replaced (e.g. `model.to(device)`):
        router r's `weight` is then a view of rows r*E .. r*E+E-1, so the matrix and the parameters are one
        tensor (in-place weight updates reach both; no second copy of the routers is kept)."""
        ws = [r.weight for r in self.routers]
        if self._router_ptrs != [(w.data_ptr(), w.dtype, w.device) for w in ws]:
            if ws[0].is_cuda and torch.cuda.is_current_stream_capturing():
                # a rebuild frees the routers' old storage, which an earlier-captured graph may still read
                raise RuntimeError(
                    "ERNIE-5.5 latent MoE: the router matrix must be built before CUDA-graph capture "
                    "(call model.prepare_after_load() after moving the model to its device)"
                )
            cat = torch.cat([w.detach() for w in ws]).contiguous()
            E = ws[0].shape[0]
            for i, w in enumerate(ws):
                w.data = cat[i * E : (i + 1) * E]
            self._router_cat = cat
            self._router_ptrs = [(w.data_ptr(), w.dtype, w.device) for w in ws]
            if cat.is_cuda:  # its one-time check runs here, before any capture
                from ..kernels.router import bf16_gemm_works

                bf16_gemm_works(cat.device)
        return self._router_cat

    def prepare_after_load(self) -> None:
        """Post-load step (`Ernie5_5_MoeForCausalLM.load_weights`): build the router matrix now unless the torch
        path is forced, so that no forward (or CUDA-graph capture) does it where it is loaded. Not decided by
        the weights' device: a model loaded on the CPU and moved to the GPU afterwards (as the GPU layer suite
        does) must not be refused here; `router_matrix()` rebuilds after such a move at its first call."""
        from ..envs import layer_impl

        if layer_impl() != "torch":
            self.router_matrix()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] fp32, ids [T, k] int32, router logits); the reference rule. The third tensor is
        what `StandardTopKOutput.router_logits` carries: FusedMoE's Triton runner (ours) reads only the ids and
        weights (SGLang 0.5.23: `fused_experts` unpacks `topk_weights, topk_ids, _`; the piecewise-graph /
        DP-gather paths pass it through unread), so each compute hands what it has at no cost: the kernels'
        raw logits [T, R*E], the torch path's mean scores [T, E]."""
        if use_kernels(x):
            from ..kernels.router import multi_router_topk, router_logits

            logits = router_logits(x, self.router_matrix())
            w, ids = multi_router_topk(
                logits,
                len(self.routers),
                self.e_score_correction_bias,
                self.topk,
                self.norm_topk_prob,
                self.scaling,
            )
            return w, ids, logits
        xf = x.float()
        s = torch.stack([torch.sigmoid(F.linear(xf, r.weight.float())) for r in self.routers]).mean(0)
        idx = torch.sort(s + self.e_score_correction_bias, dim=-1, descending=True, stable=True).indices[
            :, : self.topk
        ]
        w = s.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx.to(torch.int32), s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_range("moe.route"):
            w, ids, s = self.route(x)
        with forward_range("moe.latent"):
            z = self.latent_down(x)[0]
        with forward_range("moe.experts"):
            y = self.experts(z, StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=s))
        with forward_range("moe.latent"):
            y = self.latent_up(y)[0]
        if not self.one_reduce:
            y = sum_post_experts_output(y)  # no-op at one rank, or where the combine already summed
        if self.shared_experts is not None:
            with forward_range("moe.shared"):
                y = y + self.shared_experts(x)
        # standard dispatch: the routed and the shared partial sums in one all-reduce
        return tensor_model_parallel_all_reduce(y) if self.one_reduce else y
