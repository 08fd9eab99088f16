"""ERNIE-5.5-Flash ECHO speculative draft for SGLang (`Ernie5_5MoeMTPModel`), docs/echo.md. The draft owns
only the checkpoint's `echo.{enorm,hnorm,e_proj,h_proj,norm}`; the embedding, the backbone's last decoder
layer, `model.hc_head` and the lm_head are the target's own modules, bound by `attach_target` (the AFTER
hook on `EagleDraftWorker.init_lm_head`) before any draft forward or graph capture.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from torch import nn

from ..checkpoint.fp8 import Fp8Pairs
from ..checkpoint.spec import FORMAT_FP8, stored_tensors
from ..checkpoint.writer import INDEX_FILE
from ..configuration import ARCH_MAIN, Ernie55Config, checkpoint_config
from ..layers.attention import norm_fp32

ECHO_PREFIX = "echo."


# Test-only: when set, every eager prefill draft-extend writes its inputs and outputs to
# `<dir>/echo-<pid>-<n>.pt` (tests/echo/test_echo_gpu.py compares them with the reference).
DUMP_DIR = os.environ.get("SGLANG_ERNIE55_ECHO_DUMP_DIR", "")
_dumps = itertools.count()


def _dump(input_ids, positions, fb, hidden, R) -> None:
    """The draft's extends (over a prompt, and over the accepted tokens after each verify), for tests."""
    if not fb.forward_mode.is_extend(include_draft_extend_v2=True) or fb.forward_mode.is_target_verify():
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    lens = getattr(fb, "extend_seq_lens_cpu", None)
    out = dict(
        input_ids=input_ids, positions=positions, streams_in=fb.spec_info.hidden_states, hidden=hidden, R=R
    )
    out = {k: v.detach().cpu() for k, v in out.items()}
    out["extend_seq_lens"] = list(lens) if lens is not None else None
    torch.save(out, Path(DUMP_DIR) / f"echo-{os.getpid()}-{next(_dumps)}.pt")


class Ernie55EchoWeightError(ValueError):
    """The checkpoint's ECHO tensors do not match the draft: the message lists every problem."""


def echo_weight_files(model_path: str | None) -> list[str] | None:
    """The one safetensors shard holding every `echo.*` tensor (from the local index), as SGLang's
    `allow_patterns_overrides`, so the draft reads one shard instead of the whole checkpoint.
    None (read every shard) when the path is not local, has no index, or the tensors span shards."""
    if not model_path:
        return None
    index = Path(model_path) / INDEX_FILE
    if not index.is_file():
        return None
    files = {f for n, f in json.loads(index.read_text())["weight_map"].items() if n.startswith(ECHO_PREFIX)}
    return sorted(files) if len(files) == 1 else None


class EchoHead(nn.Module):
    """The ECHO layer's own tensors, named as the checkpoint (`echo.*`)."""

    def __init__(self, config: Ernie55Config, prefix: str = "echo"):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(H, eps=eps)
        self.hnorm = RMSNorm(H, eps=eps)
        # Unquantized: FP8 checkpoints are dequantized on load (two H x H matrices; docs/echo.md).
        self.e_proj = ReplicatedLinear(H, H, bias=False, quant_config=None, prefix=f"{prefix}.e_proj")
        self.h_proj = ReplicatedLinear(H, H, bias=False, quant_config=None, prefix=f"{prefix}.h_proj")
        self.norm = RMSNorm(H, eps=eps)


# Per entry i (SGLang's EAGLE/NEXTN layout):
#     R0 = e_proj(enorm(embed(token_{i+1})))[:, None] + h_proj(hnorm(streams_i))   -> [T, n, H]
#     R  = last_layer(R0)            # attention: window only over the draft's own KV (the draft backend)
#     logits = lm_head(echo.norm(hc_head(R)));  R (flattened) is handed back for the next chained step
# `streams_i` arrive as `forward_batch.spec_info.hidden_states` [T, n*H]: the target's pre-hc_head streams
# (its LogitsProcessor's `hidden_states_before_norm`) or, in chained steps, this draft's own R.
class Ernie5_5MoeMTPModel(nn.Module):
    """SGLang EntryClass for the ECHO draft (`_config_draft_model` maps Ernie5_5_MoeForCausalLM here)."""

    def __init__(self, config: Ernie55Config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().pp_group.world_size > 1:
            raise NotImplementedError("sglang-ernie55: pipeline parallelism is not supported yet")
        if not config.num_nextn_predict_layers:
            raise ValueError("this ERNIE-5.5 checkpoint has no ECHO layer (num_nextn_predict_layers = 0)")
        self.config = config
        self.quant_config = quant_config
        self.n, self.H = config.hc_mult, config.hidden_size
        self.echo = EchoHead(config)
        self.logits_processor = LogitsProcessor(config)
        self.allow_patterns_overrides = echo_weight_files(getattr(config, "_name_or_path", None))
        # The target's modules, bound by attach_target; a tuple so that they are not submodules of the
        # draft (the draft's state_dict / named_parameters list only what the draft owns).
        self._target: tuple = ()

    # ------------------------------------------------------------------ sharing with the target
    @property
    def attached(self) -> bool:
        return bool(self._target)

    def attach_target(self, target: nn.Module) -> None:
        """Bind the target's embedding, last decoder layer, hc_head and lm_head (modules, not copies)."""
        if type(target).__name__ != ARCH_MAIN:
            raise TypeError(f"the ECHO draft shares the weights of {ARCH_MAIN}, got {type(target).__name__}")
        m = target.model
        self._target = (m.embed_tokens, m.layers[-1], m.hc_head, target.lm_head)

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared()[0]

    @property
    def decoder_layer(self) -> nn.Module:
        return self._shared()[1]

    @property
    def hc_head(self) -> nn.Module:
        return self._shared()[2]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared()[3]

    def _shared(self) -> tuple:
        if not self._target:
            raise RuntimeError(
                "the ECHO draft runs the target's last layer, hc_head and lm_head, and was not attached to "
                "the target (the plugin's AFTER hook on EagleDraftWorker.init_lm_head does it; sglang_ernie55.patches)"
            )
        return self._target

    def get_embed_and_head(self):
        return self.embed_tokens.weight, self.lm_head.weight

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """SGLang's EAGLE worker hands the target's embedding and head here; the draft already uses the
        target's modules, so this only checks that they are the same tensors."""
        if self.attached:
            e, h = self.get_embed_and_head()
            if (
                embed is not None
                and embed.data_ptr() != e.data_ptr()
                or head is not None
                and head.data_ptr() != h.data_ptr()
            ):
                raise RuntimeError(
                    "ECHO draft: SGLang's shared embedding / lm_head are not the target's tensors"
                )

    def shared_parameter_names(self) -> list[str]:
        """Target parameter names the draft runs on (for the data-pointer proof)."""
        L = self.config.num_hidden_layers - 1
        layer = [f"model.layers.{L}.{n}" for n, _ in self.decoder_layer.named_parameters()]
        return [
            "model.embed_tokens.weight",
            *layer,
            "model.hc_head.fn",
            "model.hc_head.base",
            "model.hc_head.scale",
            "lm_head.weight",
        ]

    # ------------------------------------------------------------------ forward
    def echo_inputs(self, input_ids: torch.Tensor, streams: torch.Tensor, input_embeds=None) -> torch.Tensor:
        """R0 [T, n, H] fp32 from the next tokens and the incoming streams [T, n*H]."""
        e = self.echo
        emb = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        dtype, T = emb.dtype, emb.shape[0]
        x = e.e_proj(norm_fp32(e.enorm, emb, dtype))[0].float()
        h = streams.reshape(T * self.n, self.H)
        y = e.h_proj(norm_fp32(e.hnorm, h, dtype))[0].float().view(T, self.n, self.H)
        return x[:, None, :] + y

    def hidden(
        self, input_ids, positions, forward_batch, input_embeds=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, H] after hc_head and echo.norm, model dtype; the draft's streams R [T, n, H] fp32)."""
        dtype = self.embed_tokens.weight.dtype
        R = self.echo_inputs(input_ids, forward_batch.spec_info.hidden_states, input_embeds)
        R = self.decoder_layer(positions, R, forward_batch, dtype)
        return self.hc_head(R, self.echo.norm, dtype), R

    @torch.no_grad()
    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kwargs
    ):
        hidden, R = self.hidden(input_ids, positions, forward_batch, input_embeds)
        if DUMP_DIR:
            _dump(input_ids, positions, forward_batch, hidden, R)
        return self.logits_processor(
            input_ids,
            hidden,
            self.lm_head,
            forward_batch,
            hidden_states_before_norm=R.flatten(1).to(hidden.dtype),
        )

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: load every `echo.*` tensor exactly once (FP8 ones dequantized with their scale); every
        other tensor read must be one of the target's checkpoint tensors (it is skipped: the target
        owns it); every draft parameter loaded. Else Ernie55EchoWeightError listing every problem."""
        # every name an FP8 or BF16 checkpoint may hold, at config.json's widths (SGLang's CPU runner may pad
        # the served config)
        legal = set(stored_tensors(checkpoint_config(self.config), FORMAT_FP8))
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {p: 0 for p in params}
        errors: list[str] = []
        pairs = Fp8Pairs(lambda w: params[w].dtype if w in params else torch.bfloat16)

        def put(name: str, tensor: torch.Tensor) -> None:
            param = params.get(name)
            if param is None:
                errors.append(f"no draft parameter for {name}")
                return
            if tuple(param.shape) != tuple(tensor.shape):
                errors.append(f"{name}: checkpoint {tuple(tensor.shape)} vs parameter {tuple(param.shape)}")
                return
            param.data.copy_(tensor.to(param.dtype))
            loaded[name] += 1

        for name, tensor in weights:
            if name not in legal:
                errors.append(f"unexpected checkpoint tensor {name} {tuple(tensor.shape)}")
                continue
            if not name.startswith(ECHO_PREFIX):
                continue
            if Fp8Pairs.is_half(name, tensor):  # e_proj / h_proj are built unquantized: dequantized here
                if (pair := pairs.add(name, tensor)) is not None:
                    put(*pair)
                continue
            put(name, tensor)
        errors += pairs.finish()
        errors += [
            f"draft parameter {p} loaded {k} times (checkpoint tensor missing or duplicated)"
            for p, k in loaded.items()
            if k != 1
        ]
        if errors:
            listing = "\n  ".join(errors[:50])
            raise Ernie55EchoWeightError(
                f"ERNIE-5.5 ECHO weights do not match the draft ({len(errors)} problems):\n  {listing}"
            )
        return set(params)


EntryClass = [Ernie5_5MoeMTPModel]
