"""ERNIE-5.5-Flash main model for SGLang (`Ernie5_5_MoeForCausalLM`).

Reading order: decoder layer (mHC sites around HCA / MLA-DSA attention and the dense / latent-MoE
FFN), model (embedding -> streams -> layers -> hc_head -> norm), `Ernie5_5_MoeForCausalLM` with the
strict loader. Attention math runs in the `ernie55` backend (docs/serving-design.md).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

import torch
from sglang.srt.layers.dp_attention import (
    dp_gather_replicate,
    dp_scatter,
    get_global_dp_buffer,
    get_local_dp_buffer,
)
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.runtime_context import get_parallel, get_spec
from torch import nn

from ..checkpoint.fp8 import Fp8Pairs
from ..checkpoint.spec import FORMAT_BF16, FORMAT_FP8, SCALE_SUFFIX, stored_tensors
from ..configuration import LAYER_HCA, Ernie55Config, checkpoint_config
from ..layers.attention import Ernie55HCAAttention, Ernie55MLADSAAttention, RopeTable, norm_fp32
from ..layers.impl import check_layer_impl
from ..layers.mhc import HyperConnection, HyperHead
from ..layers.moe import Ernie55LatentMoE, Ernie55SwiGLU


def check_parallel_layout(par, a2a_backend: str = "none", speculative: bool = False) -> None:
    """Refuse the parallel layouts this model has not run (docs/serving-design.md section 8): attention context
    parallelism, attention DP other than at attention TP 1 with a TP-sharded LM head, without EP and without
    ECHO, and any MoE all-to-all backend but `none`. `par`: SGLang's `get_parallel()`; `a2a_backend`: the
    resolved --moe-a2a-backend; `speculative`: whether --speculative-algorithm is set."""
    dp, cp = int(getattr(par, "attn_dp_size", 1) or 1), int(getattr(par, "attn_cp_size", 1) or 1)
    tp = int(par.tp_size)
    ep = int(getattr(par, "moe_ep_size", 1) or 1)
    see = "See docs/serving-design.md section 8 (parallel layouts)."
    if cp > 1:
        raise NotImplementedError(
            f"sglang-ernie55 does not implement attention context parallelism yet: got tp {tp}, --attn-dp-size "
            f"{dp}, --attn-cp-size {cp}. Its attention has no prefill split across ranks (HCA's compressed blocks "
            f"and the DSA top-k would miss the other ranks' keys). Serve without --attn-cp-size. {see}"
        )
    if dp > 1:
        unrun = [
            what
            for what, on in (
                (f"attention TP {tp // dp} (only attention TP 1, --attn-dp-size = --tp, has run)", tp != dp),
                ("--enable-dp-lm-head", bool(getattr(par, "enable_dp_lm_head", False))),
                (f"expert parallelism (--ep {ep})", ep > 1),
                ("speculative decoding (ECHO)", speculative),
            )
            if on
        ]
        if unrun:
            raise NotImplementedError(
                f"sglang-ernie55 has not run attention data parallelism with {' and '.join(unrun)}: got tp {tp}, "
                f"--attn-dp-size {dp}. It runs --tp {tp} --attn-dp-size {tp} without --enable-dp-lm-head, --ep "
                f"and speculative decoding, or --tp {tp} without --attn-dp-size (legal when {tp} divides the 8 "
                f"HCA output groups). {see}"
            )
    if a2a_backend != "none":
        raise NotImplementedError(
            f"sglang-ernie55 has not run the MoE all-to-all backend `--moe-a2a-backend {a2a_backend}` (expert "
            f"parallel size {ep}): its latent MoE (latent_down before the experts, latent_up and the shared "
            "expert after them) is checked only with SGLang's standard dispatch, where every rank keeps every "
            f"token. Serve with --moe-a2a-backend none: --tp {tp} --ep {ep} then splits the routed experts "
            f"over {ep} ranks the same way. {see}"
        )


class Ernie55WeightError(ValueError):
    """A checkpoint that does not match the model: the message lists every offending tensor."""


class Ernie55DecoderLayer(nn.Module):
    def __init__(
        self, config: Ernie55Config, layer_id: int, rope: RopeTable, quant_config=None, prefix: str = ""
    ):
        super().__init__()
        n, H = config.hc_mult, config.hidden_size
        hc = dict(hc_eps=config.hc_eps, iters=config.hc_sinkhorn_iters, rms_eps=config.rms_norm_eps)
        self.kind = config.layer_types[layer_id]
        self.rope = [rope]  # not a submodule: the table is owned by the model
        self.attn_hc = HyperConnection(n, H, **hc)
        self.ffn_hc = HyperConnection(n, H, **hc)
        self.input_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, eps=config.rms_norm_eps)
        attn_cls = Ernie55HCAAttention if self.kind == LAYER_HCA else Ernie55MLADSAAttention
        self.self_attn = attn_cls(config, layer_id, rope, quant_config, f"{prefix}.self_attn")
        if config.is_moe_layer(layer_id):
            self.mlp = Ernie55LatentMoE(config, layer_id, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = Ernie55SwiGLU(H, config.intermediate_size, quant_config, f"{prefix}.mlp")
        # Under attention DP each DP rank holds its own tokens, while the FFN is sharded over the whole TP group:
        # the FFN runs on every DP rank's rows, gathered before it and scattered back after it (the streams and
        # both mHC sites stay local), as SGLang's models with a TP-sharded MLP under DP attention do.
        self.gather_ffn_tokens = get_parallel().attn_dp_size > 1

    def forward(self, positions, R: torch.Tensor, forward_batch, dtype: torch.dtype) -> torch.Tensor:
        """R [T, n, H] fp32 streams -> R' (fp32). positions: [T], or the forward's `RopePositions` (the model
        builds it once for all layers; the ECHO draft passes the raw positions of its one layer)."""
        positions = self.rope[0].at(positions)
        y, post, C = self.attn_hc.pre(R)
        a = self.self_attn(norm_fp32(self.input_layernorm, y, dtype), positions, forward_batch)
        R = self.attn_hc.post(a, R, post, C)
        y, post, C = self.ffn_hc.pre(R)
        f = self.ffn(norm_fp32(self.post_attention_layernorm, y, dtype), forward_batch)
        return self.ffn_hc.post(f, R, post, C)

    def ffn(self, x: torch.Tensor, forward_batch) -> torch.Tensor:
        """The FFN of this rank's rows x [T, H]; under attention DP over every DP rank's rows."""
        if not self.gather_ffn_tokens:
            return self.mlp(x)
        group = get_parallel().tp_group
        rows = get_global_dp_buffer(group)
        dp_gather_replicate(rows, x.contiguous(), forward_batch)
        out = get_local_dp_buffer(group)
        dp_scatter(out, self.mlp(rows), forward_batch)
        return out


class Ernie55Model(nn.Module):
    def __init__(self, config: Ernie55Config, quant_config=None, prefix: str = "model"):
        super().__init__()
        check_layer_impl()  # a bad SGLANG_ERNIE55_LAYER_IMPL fails when the model is built
        self.config = config
        self.n = config.hc_mult
        # under attention DP each rank embeds its own tokens: vocab-parallel over the attention-TP group
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            use_attn_tp_group=get_parallel().attn_dp_size > 1,
            prefix=f"{prefix}.embed_tokens",
        )
        self.rope = RopeTable(config)
        self.layers = nn.ModuleList(
            Ernie55DecoderLayer(config, i, self.rope, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(
            self.n, config.hidden_size, hc_eps=config.hc_eps, rms_eps=config.rms_norm_eps
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.start_layer, self.end_layer = 0, config.num_hidden_layers

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        dtype = h.dtype
        R = h.float()[:, None, :].expand(-1, self.n, -1).contiguous()
        rp = self.rope.at(positions)  # cos / sin of this forward's positions, once for every layer
        for layer in self.layers:
            R = layer(rp, R, forward_batch, dtype)
        hidden = norm_fp32(self.norm, self.hc_head(R), dtype)
        return hidden, R


class Ernie5_5_MoeForCausalLM(nn.Module):
    """SGLang EntryClass for `Ernie5_5_MoeForCausalLM` (BF16 or FP8 128x128 checkpoints)."""

    # Checkpoint tensors this class deliberately leaves to another model (the ECHO draft).
    _SKIP_PREFIXES = ("echo.",)
    # The routed-expert part of a checkpoint name, in the form of FusedMoE's mapping keys: `experts.{e}.{proj}.`
    _EXPERT_KEY = re.compile(r"experts\.\d+\.[a-z_]+\.")

    def __init__(self, config: Ernie55Config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.distributed.parallel_state import get_pp_group
        from sglang.srt.layers.moe import get_moe_a2a_backend

        if get_pp_group().world_size > 1:
            raise NotImplementedError("sglang-ernie55: pipeline parallelism is not supported yet")
        check_parallel_layout(
            get_parallel(),
            str(get_moe_a2a_backend().value),
            bool(getattr(get_spec(), "speculative_algorithm", None)),
        )
        self.config = config
        self.quant_config = quant_config
        # SGLang's checkpoint-name -> FusedMoE parameter table (`experts.{e}.gate_proj.` -> `experts.w13_`,
        # shard w1, ...), keyed by the checkpoint part so that a name is looked up, not searched for.
        self._expert_params = {
            ckpt: (param, expert, shard)
            for param, ckpt, expert, shard in FusedMoE.make_expert_params_mapping(
                ckpt_gate_proj_name="gate_proj",
                ckpt_down_proj_name="down_proj",
                ckpt_up_proj_name="up_proj",
                num_experts=config.n_routed_experts,
            )
        }
        self.model = Ernie55Model(config, quant_config, "model")
        # --enable-dp-lm-head: each DP rank's own rows over the attention-TP group; else the logits processor
        # gathers the rows over DP for a head sharded over the whole TP group
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            use_attn_tp_group=get_parallel().enable_dp_lm_head,
            prefix="lm_head",
        )
        self.logits_processor = LogitsProcessor(config)

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    def get_embed_and_head(self):
        return self.model.embed_tokens.weight, self.lm_head.weight

    @torch.no_grad()
    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kwargs
    ):
        hidden, streams = self.model(input_ids, positions, forward_batch, input_embeds)
        return self.logits_processor(
            input_ids,
            hidden,
            self.lm_head,
            forward_batch,
            hidden_states_before_norm=self.captured_streams(streams, hidden, forward_batch),
        )

    @staticmethod
    def captured_streams(streams: torch.Tensor, hidden: torch.Tensor, forward_batch) -> torch.Tensor | None:
        """What ECHO consumes (docs/echo.md section 5.1): the pre-hc_head residual streams [T, n*H] in the model
        dtype (EAGLE's hidden-state buffers are allocated in it; spec_hidden_size = n*H), handed to the logits
        processor as `hidden_states_before_norm`, which it returns in place of the normed hidden state whenever
        it captures (EAGLE: CaptureHiddenMode.FULL for prefill and verify). None when nothing is captured, so
        a plain prefill does not materialise a second [T, n*H] copy."""
        mode = getattr(forward_batch, "capture_hidden_mode", None)
        if mode is None or not mode.need_capture():
            return None
        return streams.flatten(1).to(hidden.dtype)

    # ------------------------------------------------------------------------------------ weights
    def checkpoint_to_param(self, name: str) -> tuple[str, tuple | None]:
        """Checkpoint tensor name -> (parameter name, FusedMoE (shard_id, expert_id) or None)."""
        m = self._EXPERT_KEY.search(name)
        hit = self._expert_params.get(m.group()) if m else None
        if hit is None:
            return name, None
        param, expert, shard = hit
        return name[: m.start()] + param + name[m.end() :], (shard, expert)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: every checkpoint tensor must be expected with its exact shape, every expected tensor
        present exactly once, every parameter loaded; else Ernie55WeightError naming them all."""
        fp8 = self.quant_config is not None
        fmt = FORMAT_FP8 if fp8 else FORMAT_BF16

        def shapes(config) -> dict[str, tuple]:
            return {n: tuple(shape) for n, (shape, _) in stored_tensors(config, fmt).items()}

        # Checkpoint tensors are checked against config.json's widths (`want`). On `--device cpu` SGLang pads the
        # MoE / FFN widths of the served config (`checkpoint_config`), so some parameters are wider (`served`):
        # such a tensor is zero-padded at its end to the served shape before its parameter's loader sees it,
        # which is what SGLang's padded CPU loaders do (the real values first, zeros after; SwiGLU rows and
        # columns of zeros add nothing) and works whichever loader branch SGLang takes.
        stored = checkpoint_config(self.config)
        want = shapes(stored)
        served = want if stored is self.config else shapes(self.config)
        params = dict(self.named_parameters())
        loads: Counter[str] = Counter()
        seen: set[str] = set()
        errors: list[str] = []

        def dtype_of(weight: str) -> torch.dtype:
            param = params.get(self.checkpoint_to_param(weight)[0])
            return param.dtype if param is not None else torch.bfloat16

        pairs = Fp8Pairs(dtype_of)  # FP8 Linears built unquantized: dequantized once both halves are here

        def put(ckpt_name: str, tensor: torch.Tensor) -> None:
            width = served.get(ckpt_name, tuple(tensor.shape))
            if width != tuple(tensor.shape):
                padded = tensor.new_zeros(width)
                padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
                tensor = padded
            pname, moe = self.checkpoint_to_param(ckpt_name)
            param = params.get(pname)
            if param is None:
                errors.append(f"no parameter for checkpoint tensor {ckpt_name} (looked for {pname})")
                return
            loader = getattr(param, "weight_loader", None)
            if moe is not None:
                shard, e = moe
                loader(param, tensor, pname, shard_id=shard, expert_id=e)
            elif loader is not None:
                loader(param, tensor)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    errors.append(
                        f"{ckpt_name}: checkpoint {tuple(tensor.shape)} vs parameter {tuple(param.shape)}"
                    )
                    return
                param.data.copy_(tensor.to(param.dtype))
            loads[pname] += 1

        for name, tensor in weights:
            if name in seen:
                errors.append(f"duplicate checkpoint tensor {name}")
                continue
            seen.add(name)
            if name not in want:
                errors.append(f"unexpected checkpoint tensor {name} {tuple(tensor.shape)}")
                continue
            if tuple(tensor.shape) != tuple(want[name]):
                errors.append(
                    f"mis-shaped checkpoint tensor {name}: {tuple(tensor.shape)}, expected {tuple(want[name])}"
                )
                continue
            if name.startswith(self._SKIP_PREFIXES):
                continue
            if fp8 and Fp8Pairs.is_half(name, tensor):
                scale_pname, _ = self.checkpoint_to_param(Fp8Pairs.weight_name(name) + SCALE_SUFFIX)
                if scale_pname in params:  # SGLang's FP8 block method owns this layer: load as stored
                    put(name, tensor)
                elif (pair := pairs.add(name, tensor)) is not None:
                    put(*pair)
                continue
            put(name, tensor)

        missing = sorted(set(want) - seen)
        errors += [f"missing checkpoint tensor {n}" for n in missing]
        errors += pairs.finish()
        errors += [f"parameter {p} was never loaded" for p in params if loads[p] == 0]
        if errors:
            head = "\n  ".join(errors[:50])
            more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
            raise Ernie55WeightError(
                f"ERNIE-5.5 checkpoint does not match the model ({len(errors)} problems):\n  {head}{more}"
            )
        self.prepare_after_load()
        return set(params)

    def prepare_after_load(self) -> None:
        """One-time layouts the per-layer kernels read (the MoE's fp32 router matrix), built once after the
        weights are in place, so that no forward or CUDA-graph capture builds them; each is also rebuilt
        lazily if its weights' storage changes."""
        for m in self.modules():
            if m is not self and hasattr(m, "prepare_after_load"):
                m.prepare_after_load()


EntryClass = [Ernie5_5_MoeForCausalLM]
