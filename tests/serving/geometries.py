"""The geometry matrix: tiny ERNIE-5.5 configs of shapes the tiny preset never takes.

Each row is a `tiny_config(**overrides)` that `Ernie55Config` accepts. Together they vary what a checkpoint
of another geometry can vary: window and compress ratio, the number of routers, the layer pattern (MLA-DSA
first, HCA only, MLA-DSA only, MLA-DSA last so the ECHO draft runs an MLA-DSA layer), head / rope / value
/ latent widths that are not powers of two (and HCA nope widths the fp8 layout cannot tile), expert counts
with `moe_intermediate_size` that is not a multiple of 32 (SGLang's CPU FusedMoE pads it), and top-k at or
near the expert count. Everything stays small (hidden 128-256, 2-4 layers, vocab 512) so that a `--device
cpu` server starts and answers in well under a minute.

`fp8_kv` is what the fp8_e4m3 KV layouts (kernels/layout.py `fp8_unfit`) decide for the row: '' when fp8
serves it, else the start of the refusal reason; the matrix tests check the rule gives exactly that.
Used by tests/serving/test_geometry_matrix_{cpu,gpu}.py and tests/test_geometry_kv_rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    name: str
    varies: str
    overrides: dict[str, Any] = field(default_factory=dict)
    fp8_kv: str = ""  # '' = fp8_e4m3 KV fits; else the config field whose value the fp8 layout refuses

    def config(self):
        from sglang_ernie55.configuration import tiny_config

        return tiny_config(**self.overrides)


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "tiny",
        "the tiny preset (reference row): window / ratio 128 / 128, 2 routers, "
        "[hca, mla_dsa, hca, hca], head 128 / rope 64, 16 experts top-4, moe_inter 96",
    ),
    Variant(
        "w64_c64_r1",
        "window 64 / ratio 64, one router, hidden 128, 8 of 8 experts, moe_inter 40, 3 layers",
        dict(
            hidden_size=128,
            num_hidden_layers=3,
            layer_types=["hca", "mla_dsa", "hca"],
            window_size=64,
            compress_ratio=64,
            num_routers=1,
            n_routed_experts=8,
            num_experts_per_tok=8,
            moe_intermediate_size=40,
            moe_latent_size=64,
            shared_expert_intermediate_size=96,
            intermediate_size=200,
            q_lora_rank=96,
            o_lora_rank=64,
        ),
    ),
    Variant(
        "w128_c32_r3_mla_first",
        "ratio 32, three routers, MLA-DSA first and no dense layer, moe_inter 72, 7 of 8 experts",
        dict(
            num_hidden_layers=3,
            layer_types=["mla_dsa", "hca", "hca"],
            first_k_dense_replace=0,
            window_size=128,
            compress_ratio=32,
            num_routers=3,
            n_routed_experts=8,
            num_experts_per_tok=7,
            moe_intermediate_size=72,
        ),
    ),
    Variant(
        "w32_c128_hca_only",
        "window 32 < ratio 128, HCA layers only, head 96 / rope 32 (nope 64), 8 heads in 4 groups",
        dict(
            num_hidden_layers=3,
            layer_types=["hca", "hca", "hca"],
            window_size=32,
            compress_ratio=128,
            head_dim=96,
            qk_rope_head_dim=32,
            num_attention_heads=8,
            o_groups=4,
            o_lora_rank=96,
            index_head_dim=48,
            moe_intermediate_size=80,
        ),
    ),
    Variant(
        "odd_mla_dims",
        "the user's checkpoint: window 64 / ratio 32, three routers, MLA-DSA first, head 96 / rope 32, "
        "v_head 48, qk_nope 40, kv_lora 96, indexer 48, moe_inter 80",
        dict(
            num_hidden_layers=4,
            layer_types=["mla_dsa", "hca", "mla_dsa", "hca"],
            window_size=64,
            compress_ratio=32,
            num_routers=3,
            head_dim=96,
            qk_rope_head_dim=32,
            v_head_dim=48,
            qk_nope_head_dim=40,
            kv_lora_rank=96,
            index_head_dim=48,
            index_n_heads=4,
            moe_intermediate_size=80,
            n_routed_experts=12,
            num_experts_per_tok=3,
        ),
        fp8_kv="kv_lora_rank",
    ),
    Variant(
        "hca_nope80",
        "head 112 / rope 32: the HCA nope width 80 is no whole number of 64-value fp8 tiles; v_head 40",
        dict(
            num_hidden_layers=3,
            layer_types=["hca", "mla_dsa", "hca"],
            head_dim=112,
            qk_rope_head_dim=32,
            qk_nope_head_dim=48,
            v_head_dim=40,
            index_head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
        ),
        fp8_kv="head_dim",
    ),
    Variant(
        "mla_last_no_shared",
        "MLA-DSA last (the ECHO draft runs an MLA-DSA layer), no shared expert, dense inter 200, "
        "hidden 192, 2 routers",
        dict(
            hidden_size=192,
            num_hidden_layers=3,
            layer_types=["hca", "hca", "mla_dsa"],
            intermediate_size=200,
            n_shared_experts=0,
            moe_intermediate_size=48,
            moe_latent_size=96,
            n_routed_experts=6,
            num_experts_per_tok=5,
            q_lora_rank=128,
        ),
    ),
    Variant(
        "mla_only",
        "MLA-DSA layers only (no SWA pool: SGLang's plain allocator), hidden 128, 2 layers, moe_inter 40",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            layer_types=["mla_dsa", "mla_dsa"],
            moe_intermediate_size=40,
            moe_latent_size=64,
            n_routed_experts=8,
            num_experts_per_tok=8,
            shared_expert_intermediate_size=72,
            q_lora_rank=96,
        ),
    ),
)

BY_NAME = {v.name: v for v in VARIANTS}


# Prompt lengths of the serving tests: 150 and 300 cross every window and compress ratio of the matrix (<= 128),
# so compressed blocks complete; 300 crosses the 256-token page, so its repeat is a one-page prefix hit.
PROMPT_LENGTHS = (19, 150, 300)


def prompts(cfg, seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Random-token prompts, BOS first."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        ids[0] = cfg.bos_token_id
        out.append(ids)
    return out


def write_checkpoint(variant: Variant, root, fmt: str = "bf16", seed: int = 0) -> str:
    """A random checkpoint of the variant (the reference model's weights for `seed`) under root/<name>-<fmt>."""
    from pathlib import Path

    from sglang_ernie55.checkpoint.tiny import make_checkpoint

    out = Path(root) / f"{variant.name}-{fmt}"
    return str(make_checkpoint(out, config=variant.config(), dtype=fmt, seed=seed))
