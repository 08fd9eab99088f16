"""The checkpoint's tensor list, derived from the config alone (docs/checkpoints.md).

`expected_tensors(config)`: every logical tensor with its shape and kind, equal to the reference model's
`state_dict()`; `stored_tensors(config, fmt)`: what a `bf16` or `fp8` checkpoint holds on disk, FP8 block
scales included. Parameter counts, the planner's weight bytes and both strict loaders derive from this list.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # configuration.py derives its parameter counts from this module
    from ..configuration import Ernie55Config

KIND_FP32 = "fp32"
KIND_BF16 = "bf16"
KIND_FP8 = "fp8"
KINDS = (KIND_FP32, KIND_BF16, KIND_FP8)

FORMAT_BF16 = "bf16"
FORMAT_FP8 = "fp8"
FORMATS = (FORMAT_BF16, FORMAT_FP8)

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0, for weights and the fp8 KV layouts
SCALE_SUFFIX = "_scale_inv"

FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "activation_scheme": "dynamic",
}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names every offending tensor.

    `missing`, `unexpected`: lists of names; `mismatched`: (name, found, expected) triples, where
    found/expected are shapes or (shape, dtype) pairs.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


def check_tensor_set(where: str, found: dict, expected: dict) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped (or mis-typed) tensor.

    `found` / `expected` map names to comparable descriptions (a shape, or a (shape, dtype) pair).
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    mismatched = [(k, found[k], expected[k]) for k in expected if k in found and found[k] != expected[k]]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: " + ", ".join(missing))
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected))
    if mismatched:
        parts.append(
            f"{len(mismatched)} mis-shaped: "
            + ", ".join(f"{k} (found {_fmt(f)}, expected {_fmt(e)})" for k, f, e in mismatched)
        )
    raise CheckpointError(
        f"{where}: " + "; ".join(parts), missing=missing, unexpected=unexpected, mismatched=mismatched
    )


def _fmt(desc) -> str:
    if isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[1], torch.dtype):
        return f"{list(desc[0])} {str(desc[1]).replace('torch.', '')}"
    return str(list(desc))


class TensorSpec(NamedTuple):
    """`kind`: `fp32` raw parameters (no `.weight` suffix), fp32 in every format; `bf16` tensors, bf16 in every
    format (embeddings, lm_head, norms, routers, `weights_proj`); `fp8` large 2-D Linear weights, bf16 in a
    BF16 checkpoint and float8_e4m3fn + fp32 `<name>_scale_inv` (one per block) in an FP8 one."""

    shape: tuple[int, ...]
    kind: str


def _linear_kind(name: str) -> str:
    """2-D Linear weights are FP8 in an FP8 checkpoint, except these."""
    keep_bf16 = ("model.embed_tokens.", "lm_head.", ".mlp.routers.", ".indexer.weights_proj.")
    return KIND_BF16 if any(k in name for k in keep_bf16) else KIND_FP8


def expected_tensors(config: Ernie55Config) -> dict[str, TensorSpec]:
    """name -> (shape, kind) of every tensor of a checkpoint for `config`, in a stable order."""
    c = config
    H, V, n = c.hidden_size, c.vocab_size, c.hc_mult
    heads = c.num_attention_heads
    out: dict[str, TensorSpec] = {}

    def linear(name: str, out_features: int, in_features: int) -> None:
        full = f"{name}.weight"
        out[full] = TensorSpec((out_features, in_features), _linear_kind(full))

    def norm(name: str, dim: int, bias: bool = False) -> None:
        out[f"{name}.weight"] = TensorSpec((dim,), KIND_BF16)
        if bias:
            out[f"{name}.bias"] = TensorSpec((dim,), KIND_BF16)

    def raw(name: str, *shape: int) -> None:
        out[name] = TensorSpec(tuple(shape), KIND_FP32)

    def hc_site(prefix: str, rows: int, scales: int) -> None:
        raw(f"{prefix}.fn", rows, n * H)
        raw(f"{prefix}.base", rows)
        raw(f"{prefix}.scale", scales)

    def swiglu(prefix: str, inner: int, width: int) -> None:
        linear(f"{prefix}.gate_proj", inner, width)
        linear(f"{prefix}.up_proj", inner, width)
        linear(f"{prefix}.down_proj", width, inner)

    hca = set(c.hca_layer_ids)
    linear("model.embed_tokens", V, H)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        hc_site(f"{p}.attn_hc", (2 + n) * n, 3)
        hc_site(f"{p}.ffn_hc", (2 + n) * n, 3)
        norm(f"{p}.input_layernorm", H)
        norm(f"{p}.post_attention_layernorm", H)
        a = f"{p}.self_attn"
        if i in hca:
            linear(f"{a}.wq_a", c.q_lora_rank, H)
            norm(f"{a}.q_norm", c.q_lora_rank)
            linear(f"{a}.wq_b", heads * c.head_dim, c.q_lora_rank)
            linear(f"{a}.wkv", c.head_dim, H)
            norm(f"{a}.kv_norm", c.head_dim)
            linear(f"{a}.wo_a", c.o_groups * c.o_lora_rank, heads // c.o_groups * c.head_dim)
            linear(f"{a}.wo_b", H, c.o_groups * c.o_lora_rank)
            raw(f"{a}.attn_sink", heads)
            linear(f"{a}.compressor.wkv_gate", 2 * c.head_dim, H)
            raw(f"{a}.compressor.ape", c.compress_ratio, c.head_dim)
            norm(f"{a}.compressor.norm", c.head_dim)
        else:
            linear(f"{a}.q_a_proj", c.q_lora_rank, H)
            norm(f"{a}.q_a_layernorm", c.q_lora_rank)
            linear(f"{a}.q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
            linear(f"{a}.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H)
            norm(f"{a}.kv_a_layernorm", c.kv_lora_rank)
            linear(f"{a}.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            linear(f"{a}.o_proj", H, heads * c.v_head_dim)
            linear(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            linear(f"{a}.indexer.wk", c.index_head_dim, H)
            norm(f"{a}.indexer.k_norm", c.index_head_dim, bias=True)  # LayerNorm
            linear(f"{a}.indexer.weights_proj", c.index_n_heads, H)
        m = f"{p}.mlp"
        if c.is_moe_layer(i):
            for r in range(c.num_routers):
                linear(f"{m}.routers.{r}", c.n_routed_experts, H)
            raw(f"{m}.e_score_correction_bias", c.n_routed_experts)
            linear(f"{m}.latent_down", c.moe_latent_size, H)
            linear(f"{m}.latent_up", H, c.moe_latent_size)
            for e in range(c.n_routed_experts):
                swiglu(f"{m}.experts.{e}", c.moe_intermediate_size, c.moe_latent_size)
            if c.n_shared_experts:
                swiglu(f"{m}.shared_experts", c.shared_expert_intermediate_size, H)
        else:
            swiglu(m, c.intermediate_size, H)
    hc_site("model.hc_head", n, 1)
    norm("model.norm", H)
    linear("lm_head", V, H)
    if c.num_nextn_predict_layers:
        norm("echo.enorm", H)
        norm("echo.hnorm", H)
        linear("echo.e_proj", H, H)
        linear("echo.h_proj", H, H)
        norm("echo.norm", H)
    return out


ROUTED_EXPERT = ".mlp.experts."


def parameter_counts(config: Ernie55Config) -> dict[str, int]:
    """Exact parameter counts of `expected_tensors(config)` (FP8 scales excluded).

    `total`: every tensor. `echo`: the ECHO layer's own tensors (`echo.*`). `active`: what one token
    runs through, i.e. everything but `echo.*`, with each MoE layer's routed experts counted at
    `num_experts_per_tok` of `n_routed_experts` (the experts of a layer are equal in size).
    """
    total = echo = routed = 0
    for name, spec in expected_tensors(config).items():
        size = math.prod(spec.shape)
        total += size
        if name.startswith("echo."):
            echo += size
        elif ROUTED_EXPERT in name:
            routed += size
    active_routed = routed // config.n_routed_experts * config.num_experts_per_tok
    return {"total": total, "active": total - echo - routed + active_routed, "echo": echo}


def scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the block-scale tensor of a 2-D weight: one entry per block, ragged edges rounded up."""
    rows, cols = shape
    return (math.ceil(rows / block), math.ceil(cols / block))


def stored_tensors(config: Ernie55Config, fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor a checkpoint of format `fmt` (bf16 | fp8) holds on disk."""
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format must be one of {FORMATS}, got {fmt!r}")
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, kind) in expected_tensors(config).items():
        if kind == KIND_FP32:
            out[name] = (shape, torch.float32)
        elif kind == KIND_FP8 and fmt == FORMAT_FP8:
            out[name] = (shape, FP8_DTYPE)
            out[name + SCALE_SUFFIX] = (scale_shape(shape), torch.float32)
        else:
            out[name] = (shape, torch.bfloat16)
    return out


def checkpoint_format(config: Ernie55Config | dict) -> str:
    """`fp8` when the config carries an FP8 `quantization_config`, else `bf16`. Raises on other methods."""
    qc = (
        config.get("quantization_config")
        if isinstance(config, dict)
        else getattr(config, "quantization_config", None)
    )
    if not qc:
        return FORMAT_BF16
    qc = dict(qc)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json quantization_config.quant_method = {method!r}: only 'fp8' is supported"
        )
    if list(qc.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(
            f"config.json quantization_config.weight_block_size = {qc.get('weight_block_size')!r}: "
            f"only [{FP8_BLOCK}, {FP8_BLOCK}] is supported"
        )
    return FORMAT_FP8
