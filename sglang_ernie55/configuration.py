"""`Ernie55Config`: the config.json schema of ERNIE-5.5-Flash (model_type `ernie5_5_moe`).

Every field with its full-size default. `check_fields()` runs on construction and raises
`Ernie55ConfigError` naming the field and the rule it breaks.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

MODEL_TYPE = "ernie5_5_moe"
ARCH_MAIN = "Ernie5_5_MoeForCausalLM"
ARCH_ECHO = "Ernie5_5MoeMTPModel"
ARCH_DSPARK = "Ernie5_5_MoeDSparkDraftModel"
ARCHITECTURES = (ARCH_MAIN, ARCH_ECHO)

LAYER_HCA = "hca"
LAYER_MLA_DSA = "mla_dsa"
LAYER_KINDS = (LAYER_HCA, LAYER_MLA_DSA)

# SGLang serves this model with 256-token pages; a page must hold a whole number of compressed HCA
# entries (SERVING_PAGE_SIZE / compress_ratio of them). The one definition of the page size.
SERVING_PAGE_SIZE = 256
# The full model's HCA window and compress ratio (config.json defaults, the kernels' full-size geometry).
HCA_WINDOW = 128
HCA_COMPRESS_RATIO = 128

DEFAULT_ROPE_SCALING = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}


class Ernie55ConfigError(ValueError):
    """A config.json value that ERNIE-5.5 cannot run with; the message names the field."""


def default_layer_types(num_hidden_layers: int) -> list[str]:
    """`mla_dsa` where i % 7 == 3, `hca` elsewhere (the full model: 6 MLA-DSA and 37 HCA layers)."""
    return [LAYER_MLA_DSA if i % 7 == 3 else LAYER_HCA for i in range(num_hidden_layers)]


class Ernie55Config(PretrainedConfig):
    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 103424,
        hidden_size: int = 4096,
        num_hidden_layers: int = 43,
        layer_types: list[str] | None = None,
        first_k_dense_replace: int = 1,
        intermediate_size: int = 12288,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 1048576,
        rope_theta: float = 160000.0,
        rope_scaling: dict[str, Any] | None = None,
        num_attention_heads: int = 64,
        q_lora_rank: int = 1024,
        # HCA
        head_dim: int = 512,
        qk_rope_head_dim: int = 64,
        window_size: int = HCA_WINDOW,
        compress_ratio: int = HCA_COMPRESS_RATIO,
        o_groups: int = 8,
        o_lora_rank: int = 1024,
        # MLA-DSA
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        v_head_dim: int = 128,
        index_n_heads: int = 64,
        index_head_dim: int = 128,
        index_topk: int = 2048,
        # MoE
        n_routed_experts: int = 512,
        num_experts_per_tok: int = 10,
        n_shared_experts: int = 1,
        moe_latent_size: int = 2048,
        moe_intermediate_size: int = 2048,
        shared_expert_intermediate_size: int = 2048,
        num_routers: int = 2,
        scoring_func: str = "sigmoid",
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 2.5,
        # mHC
        hc_mult: int = 4,
        hc_sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        # ECHO
        num_nextn_predict_layers: int = 1,
        echo_reuses_last_layer: bool = True,
        tie_word_embeddings: bool = False,
        dtype: str = "bfloat16",
        **kwargs: Any,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.first_k_dense_replace = first_k_dense_replace
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = dict(DEFAULT_ROPE_SCALING) if rope_scaling is None else rope_scaling
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.head_dim = head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.window_size = window_size
        self.compress_ratio = compress_ratio
        self.o_groups = o_groups
        self.o_lora_rank = o_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.moe_latent_size = moe_latent_size
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_routers = num_routers
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.echo_reuses_last_layer = echo_reuses_last_layer
        # One shared KV head (HCA: K = V; MLA: one latent). SGLang reads this field.
        self.num_key_value_heads = 1
        kwargs.setdefault("architectures", [ARCH_MAIN])
        if "torch_dtype" in kwargs:  # older spelling in config.json
            dtype = kwargs.pop("torch_dtype") or dtype
        super().__init__(tie_word_embeddings=tie_word_embeddings, dtype=dtype, **kwargs)
        # Set after the base __init__: transformers' class-level `validate_layer_type` only knows its own
        # layer kinds ("full_attention", ...); `check_fields` validates ours.
        self.layer_types = (
            list(layer_types) if layer_types is not None else default_layer_types(num_hidden_layers)
        )
        self.check_fields()

    # ------------------------------------------------------------------ derived facts
    @property
    def hca_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LAYER_HCA]

    @property
    def mla_dsa_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LAYER_MLA_DSA]

    # SGLang's hybrid-SWA opt-in (`is_hybrid_swa_model`, `get_hybrid_layer_ids`): the HCA layers' window
    # lives in the SWA pool (1), MLA-DSA layers keep every token in the full pool (0). Not in config.json.
    @property
    def is_hybrid_swa(self) -> bool:
        return LAYER_HCA in self.layer_types

    @property
    def hybrid_layer_pattern(self) -> list[int]:
        return [1 if t == LAYER_HCA else 0 for t in self.layer_types]

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """transformers' strict validators (called by save_pretrained), minus `validate_layer_type`, which
        only knows transformers' own layer kinds; then this model's rules."""
        for validator in PretrainedConfig.__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self.check_fields()

    def check_fields(self) -> None:
        """Raise Ernie55ConfigError naming the first field that breaks a rule."""

        def fail(field: str, rule: str, value: Any) -> None:
            raise Ernie55ConfigError(f"config.json `{field}` = {value!r}: {rule}")

        positive = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "q_lora_rank",
            "head_dim",
            "qk_rope_head_dim",
            "window_size",
            "compress_ratio",
            "o_groups",
            "o_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_latent_size",
            "moe_intermediate_size",
            "num_routers",
            "hc_mult",
            "hc_sinkhorn_iters",
            "max_position_embeddings",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                fail(name, "must be a positive integer", v)
        if len(self.layer_types) != self.num_hidden_layers:
            fail(
                "layer_types",
                f"must have num_hidden_layers = {self.num_hidden_layers} entries, has {len(self.layer_types)}",
                self.layer_types,
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_KINDS})
        if bad:
            fail("layer_types", f"entries must be one of {list(LAYER_KINDS)}; found {bad}", self.layer_types)
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail(
                "first_k_dense_replace",
                f"must be in [0, num_hidden_layers={self.num_hidden_layers}]",
                self.first_k_dense_replace,
            )
        if self.num_attention_heads % self.o_groups:
            fail("o_groups", f"must divide num_attention_heads = {self.num_attention_heads}", self.o_groups)
        for name in ("head_dim", "qk_nope_head_dim", "index_head_dim"):
            if self.qk_rope_head_dim > getattr(self, name) and name == "head_dim":
                fail("qk_rope_head_dim", f"must not exceed head_dim = {self.head_dim}", self.qk_rope_head_dim)
        for name in ("qk_rope_head_dim", "head_dim", "index_head_dim"):
            if getattr(self, name) % 2:
                fail(name, "must be even (RoPE rotates pairs of dims)", getattr(self, name))
        if self.index_head_dim < self.qk_rope_head_dim:
            fail(
                "index_head_dim",
                f"must be >= qk_rope_head_dim = {self.qk_rope_head_dim} (indexer RoPE)",
                self.index_head_dim,
            )
        if SERVING_PAGE_SIZE % self.compress_ratio:
            fail(
                "compress_ratio",
                f"must divide the serving page size {SERVING_PAGE_SIZE} so that every page "
                "holds a whole number of compressed entries",
                self.compress_ratio,
            )
        if self.window_size > SERVING_PAGE_SIZE:
            fail("window_size", f"must be <= the serving page size {SERVING_PAGE_SIZE}", self.window_size)
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(
                "num_experts_per_tok",
                f"must be <= n_routed_experts = {self.n_routed_experts}",
                self.num_experts_per_tok,
            )
        if self.n_shared_experts not in (0, 1):
            fail("n_shared_experts", "must be 0 or 1 (one full-width shared expert)", self.n_shared_experts)
        if self.scoring_func != "sigmoid":
            fail("scoring_func", "only 'sigmoid' is defined for ERNIE-5.5", self.scoring_func)
        if self.num_nextn_predict_layers not in (0, 1):
            fail("num_nextn_predict_layers", "must be 0 or 1 (one ECHO layer)", self.num_nextn_predict_layers)
        if self.num_nextn_predict_layers and not self.echo_reuses_last_layer:
            fail("echo_reuses_last_layer", "must be true: ECHO reuses the backbone's last layer", False)
        rs = self.rope_scaling
        if rs is not None:
            kind = rs.get("type", rs.get("rope_type"))
            if kind != "yarn":
                fail("rope_scaling.type", "only 'yarn' is defined for ERNIE-5.5", kind)
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if key not in rs:
                    fail(f"rope_scaling.{key}", "is required for yarn", None)

    # ------------------------------------------------------------------ parameter arithmetic
    def parameter_counts(self) -> dict[str, int]:
        """Exact parameter counts: total, active per token (top-k routed + shared experts + everything
        dense, lm_head and embedding included) and the ECHO extra; a sum over `checkpoint.spec`'s tensors."""
        from .checkpoint.spec import parameter_counts

        return parameter_counts(self)

    # ------------------------------------------------------------------ checkpoint form
    SCHEMA_FIELDS = (
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "layer_types",
        "first_k_dense_replace",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "num_attention_heads",
        "q_lora_rank",
        "head_dim",
        "qk_rope_head_dim",
        "window_size",
        "compress_ratio",
        "o_groups",
        "o_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_latent_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_routers",
        "scoring_func",
        "norm_topk_prob",
        "routed_scaling_factor",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "num_nextn_predict_layers",
        "echo_reuses_last_layer",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "dtype",
    )

    def to_config_json(self) -> dict[str, Any]:
        """config.json as the checkpoint ships it (`rope_scaling` in its original form, not transformers'
        `rope_parameters`), plus `quantization_config` when set."""
        out: dict[str, Any] = {}
        for key in self.SCHEMA_FIELDS:
            if key == "model_type":
                out[key] = MODEL_TYPE
            elif key == "rope_scaling":
                rs = self.rope_scaling
                out[key] = (
                    None
                    if rs is None
                    else {
                        k: rs[k]
                        for k in (
                            "type",
                            "factor",
                            "original_max_position_embeddings",
                            "beta_fast",
                            "beta_slow",
                            "mscale",
                            "mscale_all_dim",
                        )
                        if k in rs
                    }
                    | {"type": rs.get("type", rs.get("rope_type"))}
                )
            elif key == "dtype":
                dt = getattr(self, "dtype", None)
                out[key] = str(dt).replace("torch.", "") if dt is not None else "bfloat16"
            else:
                out[key] = getattr(self, key, None)
        qc = getattr(self, "quantization_config", None)
        if qc:
            out["quantization_config"] = dict(qc)
        return out


# Widths SGLang's CPU model runner pads in the served config (`update_intermediate_size`), keeping
# config.json's value as `original_<name>`; the loaders zero the padding (SwiGLU of zeros adds nothing).
SGLANG_PADDED_WIDTHS = ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size")


def checkpoint_config(config: Ernie55Config) -> Ernie55Config:
    """The geometry the checkpoint was written in: `config`, or a copy with config.json's values of the
    `SGLANG_PADDED_WIDTHS` put back. Checkpoint tensor shapes are checked against this."""
    restored = {
        name: getattr(config, f"original_{name}")
        for name in SGLANG_PADDED_WIDTHS
        if getattr(config, f"original_{name}", None) not in (None, getattr(config, name))
    }
    if not restored:
        return config
    out = copy.copy(config)
    for name, value in restored.items():
        setattr(out, name, value)
    out.check_fields()
    return out


def tiny_config(**overrides: Any) -> Ernie55Config:
    """The tiny test geometry: every feature of the full model at small width.

    4 layers (dense layer 0, one MLA-DSA layer, HCA elsewhere, the last (ECHO's) HCA); the full model's
    window and compress ratio, so page / block / window boundaries sit where they do in serving;
    index_topk 64, so DSA really selects; q_lora 192, kv_a 128+64, o_lora 160, so FP8 block scales have
    ragged edges as well as whole blocks.
    """
    cfg: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["hca", "mla_dsa", "hca", "hca"],
        first_k_dense_replace=1,
        intermediate_size=384,
        num_attention_heads=16,
        q_lora_rank=192,
        head_dim=128,
        qk_rope_head_dim=64,
        window_size=HCA_WINDOW,
        compress_ratio=HCA_COMPRESS_RATIO,
        o_groups=8,
        o_lora_rank=160,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_latent_size=128,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=192,
        num_routers=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    return Ernie55Config(**cfg)
