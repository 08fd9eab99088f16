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
from sglang.srt.runtime_context import get_device, get_parallel, get_spec
from torch import nn

from ..args.rules import parallel_layout_refusal
from ..attention.cp import ffn_rows, is_split
from ..checkpoint.fp8 import Fp8Pairs
from ..checkpoint.spec import FORMAT_BF16, FORMAT_FP8, SCALE_SUFFIX, stored_tensors
from ..configuration import LAYER_HCA, Ernie55Config, checkpoint_config
from ..layers.attention import Ernie55HCAAttention, Ernie55MLADSAAttention, RopeTable
from ..layers.impl import check_layer_impl
from ..layers.mhc import HyperConnection, HyperHead
from ..layers.moe import Ernie55LatentMoE, Ernie55SwiGLU
from ..profiling import forward_range


def check_parallel_layout(
    par, a2a_backend: str = "none", speculative: bool = False, device: str = "cuda"
) -> None:
    """Refuse the parallel layouts this model has not run (`args.rules.parallel_layout_refusal`). `par`:
    SGLang's `get_parallel()`; `a2a_backend`: the resolved --moe-a2a-backend; `speculative`: whether
    --speculative-algorithm is set; `device`: the server's --device."""
    why = parallel_layout_refusal(
        int(par.tp_size),
        int(getattr(par, "attn_dp_size", 1) or 1),
        int(getattr(par, "attn_cp_size", 1) or 1),
        int(getattr(par, "moe_ep_size", 1) or 1),
        bool(getattr(par, "enable_dp_lm_head", False)),
        a2a_backend,
        speculative,
        device=device,
    )
    if why:
        raise NotImplementedError(why)


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
        self.ffn_range = "moe" if config.is_moe_layer(layer_id) else "dense_ffn"  # forward_range names
        # Under attention DP each DP rank holds its own tokens, while the FFN is sharded over the whole TP group:
        # the FFN runs on every DP rank's rows, gathered before it and scattered back after it (the streams and
        # both mHC sites stay local), as SGLang's models with a TP-sharded MLP under DP attention do.
        self.gather_ffn_tokens = get_parallel().attn_dp_size > 1

    def forward(self, positions, R: torch.Tensor, forward_batch, dtype: torch.dtype, mixed=None, then=None):
        """R [T, n, H] fp32 streams -> R' (fp32). positions: [T], or the forward's `RopePositions` (the model
        builds it once for all layers; the ECHO draft passes the raw positions of its one layer). The model's
        loop also passes `mixed`, this layer's first-site mix of R made by the previous layer (None: the
        site mixes), and `then`, the next site (the next layer's `attn_hc`, or `hc_head`): with `then` the
        result is (R', the mix of R' for `then` or None), from `HyperConnection.post_mix`."""
        positions = self.rope[0].at(positions)
        # each mHC site's pre also applies the sub-layer's input norm (one launch on the kernels)
        with forward_range("mhc"):
            x, post, C = self.attn_hc.pre(R, self.input_layernorm, dtype, mixed)
        with forward_range(self.kind):
            a = self.self_attn(x, positions, forward_batch)
        with forward_range("mhc"):
            R, mixed = self.attn_hc.post_mix(a, R, post, C, self.ffn_hc)
            x, post, C = self.ffn_hc.pre(R, self.post_attention_layernorm, dtype, mixed)
        with forward_range(self.ffn_range):
            f = self.ffn(x, forward_batch)
        with forward_range("mhc"):
            if then is None:
                return self.ffn_hc.post(f, R, post, C)
            return self.ffn_hc.post_mix(f, R, post, C, then)

    def ffn(self, x: torch.Tensor, forward_batch) -> torch.Tensor:
        """The FFN of this rank's rows x [T, H]; under attention DP over every DP rank's rows, under a prefill-CP
        split over every CP rank's rows (attention.cp.ffn_rows)."""
        if is_split(forward_batch):
            return ffn_rows(x, self.mlp)
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
        with forward_range("embed"):
            h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
            dtype = h.dtype
            # the n streams start as copies of h: one cast-and-broadcast copy (no fp32 [T, H] in between)
            R = h.new_empty(h.shape[0], self.n, h.shape[1], dtype=torch.float32)
            R.copy_(h[:, None, :])
            rp = self.rope.at(positions)  # cos / sin of this forward's positions, once for every layer
        hidden, R = self.layers_and_head(rp, R, forward_batch, dtype)
        if is_split(forward_batch):
            # SGLang's prefill-CP runner calls this body on the rank's rows, all-gathers every tensor it returns
            # and hands a second one to the logits processor as hidden_states_before_norm: the streams only
            # when they are captured, so that a plain split prefill gathers [T, H], not also [T, n, H] fp32
            captured = Ernie5_5_MoeForCausalLM.captured_streams(R, hidden, forward_batch)
            return hidden if captured is None else (hidden, captured)
        return hidden, R

    def layers_and_head(self, rp, R: torch.Tensor, forward_batch, dtype: torch.dtype):
        """The decoder layers over the streams R [T, n, H] fp32, then hc_head and the final norm: (hidden
        [T, H] in `dtype`, the streams before hc_head). Each mHC site's post hands the next site its mix
        where the kernels take it (`HyperConnection.post_mix`)."""
        mixed, last = None, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            then = self.hc_head if i == last else self.layers[i + 1].attn_hc
            R, mixed = layer(rp, R, forward_batch, dtype, mixed, then)
        with forward_range("mhc"):
            return self.hc_head(R, self.norm, dtype, mixed), R


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
            device=str(get_device().device or ""),
        )
        self.pp_group = (
            get_pp_group()
        )  # SGLang's prefill-CP runner asks the model whether it is the last stage
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
        # Checkpoint Linears served merged (`layers.linear.InputProjections`, the SwiGLUs' gate_up_proj): the
        # checkpoint module name -> (the merged Linear's module name, shard id), read off the modules themselves
        self._merged = {
            part: (name, shard)
            for name, mod in self.named_modules()
            for shard, part in enumerate(getattr(mod, "ernie_parts", ()))
        }
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

    def get_input_embeddings(self) -> nn.Module:
        """SGLang's prefill-CP runner embeds the whole batch with it, then hands each rank its rows."""
        return self.model.embed_tokens

    @torch.no_grad()
    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kwargs
    ):
        hidden, streams = self.model(input_ids, positions, forward_batch, input_embeds)
        with forward_range("lm_head"):
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
    def checkpoint_to_param(self, name: str) -> tuple[str, tuple | int | None]:
        """Checkpoint tensor name -> (parameter name, where in it): FusedMoE's (shard_id, expert_id) for a routed
        expert, the shard id (an int) for a part of a merged Linear, None for a parameter of its own."""
        m = self._EXPERT_KEY.search(name)
        hit = self._expert_params.get(m.group()) if m else None
        if hit is not None:
            param, expert, shard = hit
            return name[: m.start()] + param + name[m.end() :], (shard, expert)
        module, _, leaf = name.rpartition(".")
        merged = self._merged.get(module)
        if merged is not None:
            return f"{merged[0]}.{leaf}", merged[1]
        return name, None

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
            pname, where = self.checkpoint_to_param(ckpt_name)
            param = params.get(pname)
            if param is None:
                errors.append(f"no parameter for checkpoint tensor {ckpt_name} (looked for {pname})")
                return
            loader = getattr(param, "weight_loader", None)
            if isinstance(where, tuple):
                shard, e = where
                loader(param, tensor, pname, shard_id=shard, expert_id=e)
            elif where is not None:
                loader(param, tensor, where)  # a merged Linear's shard
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
        """One-time layouts the per-layer kernels read (the MoE's router matrix), built once after the
        weights are in place, so that no forward or CUDA-graph capture builds them; each is also rebuilt
        lazily if its weights' storage changes."""
        for m in self.modules():
            if m is not self and hasattr(m, "prepare_after_load"):
                m.prepare_after_load()


EntryClass = [Ernie5_5_MoeForCausalLM]
