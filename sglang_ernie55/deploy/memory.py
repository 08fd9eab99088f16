"""Memory planner: weight bytes per GPU, KV bytes per token, pool sizes and a fits / does-not-fit verdict for
a hardware cell, all derived from `Ernie55Config`, the checkpoint's tensor list and the KV layouts of
`sglang_ernie55.kernels.layout`. The budget model (weights + runtime reserve + prefill scratch + request
state + KV pool, in 10^9-byte GB) and the verdict rule are in docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ..checkpoint.spec import KIND_BF16, KIND_FP32, expected_tensors, scale_shape
from ..configuration import SERVING_PAGE_SIZE
from .cells import GPUS, Cell, Gpu

GB = 1e9
RESERVE_FRACTION = 0.10
KV_SHARE_MIN = 0.25
SWA_FULL_TOKENS_RATIO = 0.1  # the model's default `--swa-full-tokens-ratio`
DEFAULT_CONTEXT = 131072  # training context; the cells' default
DEFAULT_CHUNKED_PREFILL = 8192
# Layout of the minimum-GPU table: attention TP may not exceed the 8 HCA output groups, so counts
# beyond 8 add attention-DP ranks (tp 16 -> attention DP 2, attention TP 8).
CANDIDATE_GPU_COUNTS = (1, 2, 4, 8, 16, 32)


# ------------------------------------------------------------------------------------------ weights
@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor as the planner sees it: its sharding group and its spec entry."""

    name: str
    group: str  # attention | ffn | router | embedding | lm_head | replicated | echo
    shape: tuple[int, ...]
    kind: str  # checkpoint.spec kind: fp32 | bf16 | fp8 (an FP8 Linear in the FP8 checkpoint)

    @property
    def params(self) -> int:
        return math.prod(self.shape)


def sharding_group(name: str) -> str:
    """How SGLang shards a checkpoint tensor, from its name (see the module docstring)."""
    if name.startswith("echo."):
        return "echo"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.routers." in name or name.endswith(".mlp.e_score_correction_bias"):
        return "router"
    if ".mlp." in name:  # dense FFN, latent projections, routed and shared experts
        return "ffn"
    return "replicated"  # mHC sites, the layers' norms, model.norm, hc_head


def checkpoint_tensors(cfg) -> list[Tensor]:
    """Every tensor of the checkpoint (`checkpoint.spec.expected_tensors`) with its sharding group."""
    return [Tensor(n, sharding_group(n), s.shape, s.kind) for n, s in expected_tensors(cfg).items()]


def _tensor_bytes(t: Tensor, precision: str) -> float:
    if t.kind == KIND_FP32:
        return 4.0 * t.params
    if t.kind == KIND_BF16 or precision == "bf16":
        return 2.0 * t.params
    # FP8 Linear: 1 byte per weight + one fp32 scale per 128x128 block (ragged edge blocks count whole)
    return t.params + 4.0 * math.prod(scale_shape(t.shape))


# The full model's list has 65k tensors (64,512 routed-expert matrices); a GPU-count search plans the same
# config dozens of times, so its bytes per group are summed once per config.json and precision.
_GROUP_BYTES: dict[tuple[str, str], dict[str, float]] = {}


def weight_bytes_by_group(cfg, precision: str) -> dict[str, float]:
    """Checkpoint bytes per sharding group."""
    key = (json.dumps(cfg.to_config_json(), sort_keys=True, default=str), precision)
    if key not in _GROUP_BYTES:
        groups: dict[str, float] = {}
        for t in checkpoint_tensors(cfg):
            groups[t.group] = groups.get(t.group, 0.0) + _tensor_bytes(t, precision)
        _GROUP_BYTES[key] = groups
    return dict(_GROUP_BYTES[key])


def checkpoint_bytes(cfg, precision: str) -> float:
    return sum(weight_bytes_by_group(cfg, precision).values())


# ------------------------------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """What the planner reads from a cell's flags (SGLang's meaning of each)."""

    gpu: Gpu
    precision: str
    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    attn_dp: int = 1
    attn_cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    enable_dp_lm_head: bool = False
    speculative: bool = False
    kv_cache_dtype: str = "fp8_e4m3"
    context_length: int = DEFAULT_CONTEXT
    max_running_requests: int | None = None
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL
    swa_full_tokens_ratio: float = SWA_FULL_TOKENS_RATIO
    hicache_ratio: float | None = None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def attn_tp(self) -> int:
        return self.tp // (self.attn_dp * self.attn_cp)

    @property
    def prefill_chunk_per_rank(self) -> int:
        """SGLang divides --chunked-prefill-size among the attention-DP ranks."""
        return max(1, self.chunked_prefill_size // self.attn_dp)

    @property
    def kv_ranks(self) -> int:
        """Distinct KV pools in the server (one per attention-DP rank per DP replica)."""
        return self.attn_dp * self.dp

    @property
    def requests_per_rank(self) -> int | None:
        if self.max_running_requests is None:
            return None
        return math.ceil(self.max_running_requests / self.kv_ranks)

    @classmethod
    def from_cell(cls, cell: Cell, **overrides: Any) -> Layout:
        f = cell.flags
        kw: dict[str, Any] = dict(
            gpu=cell.gpu,
            precision=cell.precision,
            nodes=cell.nodes,
            gpus_per_node=cell.gpus_per_node,
            tp=int(f.get("tp-size", 1)),
            attn_dp=int(f.get("attn-dp-size", 1)),
            attn_cp=int(f.get("attn-cp-size", 1)),
            pp=int(f.get("pp-size", 1)),
            dp=int(f.get("dp-size", 1)),
            ep=int(f.get("ep-size", 1)),
            enable_dp_lm_head=bool(f.get("enable-dp-lm-head", False)),
            speculative=bool(f.get("speculative-algorithm")),
            kv_cache_dtype=str(f.get("kv-cache-dtype", "fp8_e4m3")),
            context_length=int(f.get("context-length", DEFAULT_CONTEXT)),
            max_running_requests=int(f["max-running-requests"]) if "max-running-requests" in f else None,
            chunked_prefill_size=int(f.get("chunked-prefill-size", DEFAULT_CHUNKED_PREFILL)),
            swa_full_tokens_ratio=float(f.get("swa-full-tokens-ratio", SWA_FULL_TOKENS_RATIO)),
            hicache_ratio=float(f["hicache-ratio"]) if "hicache-ratio" in f else None,
        )
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    @classmethod
    def minimal(cls, gpu: Gpu, precision: str, num_gpus: int, **kw: Any) -> Layout:
        """The layout of the minimum-GPU table: tensor parallel over every GPU; beyond 8 GPUs attention
        DP keeps the attention TP at 8 (the HCA output groups)."""
        attn_dp = max(1, num_gpus // 8)
        nodes = max(1, math.ceil(num_gpus / gpu.gpus_per_node))
        return cls(
            gpu=gpu,
            precision=precision,
            tp=num_gpus,
            attn_dp=attn_dp,
            nodes=nodes,
            gpus_per_node=min(num_gpus, gpu.gpus_per_node),
            **kw,
        )


# ------------------------------------------------------------------------------------------ KV
def kv_bytes_per_token(cfg, kv_cache_dtype: str) -> dict[str, float]:
    """Bytes per token per layer, by pool: what the serving pool allocates (`mem_cache.sizing.kv_bytes`, from
    the byte layouts of `sglang_ernie55.kernels.layout`, page padding included).

    Keys: `mla` (latent + rope, every MLA-DSA layer), `indexer` (DSA key, every MLA-DSA layer),
    `hca_window` (raw window entry in the SWA pool, every HCA layer), `hca_compressed` (one
    compressed entry, per `compress_ratio` tokens, every HCA layer).
    """
    from ..mem_cache.sizing import kv_bytes

    b = kv_bytes(cfg, kv_cache_dtype)
    return {
        "mla": b.latent_row,
        "indexer": b.index_row,
        "hca_window": b.window_row,
        "hca_compressed": b.cmp_row,
    }


def pool_bytes_per_token(
    cfg, kv_cache_dtype: str, *, speculative: bool, swa_ratio: float
) -> dict[str, float]:
    """Per token of the full pool: full-pool bytes, SWA-pool bytes (per SWA token) and their sum at the ratio;
    the serving pool configurator's numbers (`mem_cache.sizing.KVBytes.per_full_token`)."""
    from ..mem_cache.sizing import kv_bytes

    # ECHO runs the backbone's last layer over its window only: one more window layer in the SWA pool.
    b = kv_bytes(cfg, kv_cache_dtype, echo=bool(speculative and cfg.num_nextn_predict_layers))
    full = b.per_full_token(0.0)
    return {"full": full, "swa": b.per_swa_token(), "per_token": b.per_full_token(swa_ratio)}


def request_state_bytes(cfg, speculative: bool = False) -> float:
    """HCA open-block compressor state per request slot: fp32 [compress_ratio, 2 * head_dim] per HCA layer,
    two blocks of it under speculative decoding (the pool's ring, sglang_ernie55.mem_cache.sizing)."""
    blocks = 2 if speculative else 1
    return len(cfg.hca_layer_ids) * blocks * cfg.compress_ratio * 2 * cfg.head_dim * 4.0


# ------------------------------------------------------------------------------------------ plan
@dataclasses.dataclass
class Plan:
    layout: Layout
    weights: dict[str, float]  # per GPU, by group
    reserve: float
    scratch: float
    state: float
    kv_pool: float
    kv_per_token: dict[str, float]  # per layer, by pool
    pool_per_token: dict[str, float]
    max_tokens_per_rank: int
    max_tokens_server: int
    swa_tokens_per_rank: int
    fits: bool
    reasons: list[str]
    notes: list[str]

    @property
    def weights_total(self) -> float:
        return sum(self.weights.values())

    def max_context_at(self, concurrency: int) -> int:
        """Longest context every one of `concurrency` requests can hold at once (spread over the KV ranks)."""
        per_rank = math.ceil(concurrency / self.layout.kv_ranks)
        if per_rank <= 0:
            return 0
        return min(self.layout.context_length, self.max_tokens_per_rank * self.layout.attn_cp // per_rank)

    def max_concurrency_at(self, context: int) -> int:
        return self.layout.kv_ranks * (self.max_tokens_per_rank * self.layout.attn_cp // max(1, context))

    def as_dict(self) -> dict[str, Any]:
        L = self.layout
        return {
            "hardware": L.gpu.key,
            "gpu_memory_gb": L.gpu.memory_gb,
            "precision": L.precision,
            "gpus": L.num_gpus,
            "nodes": L.nodes,
            "tp": L.tp,
            "attn_dp": L.attn_dp,
            "attn_cp": L.attn_cp,
            "attn_tp": L.attn_tp,
            "kv_cache_dtype": L.kv_cache_dtype,
            "context_length": L.context_length,
            "max_running_requests": L.max_running_requests,
            "weights_gb_per_gpu": round(self.weights_total / GB, 2),
            "weights_gb_by_group": {k: round(v / GB, 3) for k, v in self.weights.items()},
            "reserve_gb": round(self.reserve / GB, 2),
            "prefill_scratch_gb": round(self.scratch / GB, 2),
            "request_state_gb": round(self.state / GB, 2),
            "kv_pool_gb": round(self.kv_pool / GB, 2),
            "kv_bytes_per_token_per_layer": self.kv_per_token,
            "pool_bytes_per_token": {k: round(v, 1) for k, v in self.pool_per_token.items()},
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "max_tokens_server": self.max_tokens_server,
            "swa_tokens_per_rank": self.swa_tokens_per_rank,
            "max_context_at_max_running_requests": (
                self.max_context_at(L.max_running_requests) if L.max_running_requests else None
            ),
            "max_concurrency_at_context_length": self.max_concurrency_at(L.context_length),
            "fits": self.fits,
            "reasons": self.reasons,
            "notes": self.notes,
        }


def plan(cfg, layout: Layout) -> Plan:
    groups = weight_bytes_by_group(cfg, layout.precision)
    L = layout
    shard = {
        "attention": L.attn_tp,
        "ffn": L.tp,
        "router": 1,
        "embedding": L.attn_tp,
        "lm_head": L.attn_tp if L.enable_dp_lm_head else L.tp,
        "replicated": 1,
        "echo": 1,
    }
    weights = {}
    for g, b in groups.items():
        if g == "echo" and not L.speculative:
            continue
        per_stage = b / L.pp if g in ("attention", "ffn", "router", "replicated") else b
        weights[g] = per_stage / shard[g]
    hbm = L.gpu.memory_gb * GB
    reserve = RESERVE_FRACTION * hbm
    scratch = L.prefill_chunk_per_rank * L.context_length / max(1, L.attn_cp) * 4.0
    slots = L.requests_per_rank or 0
    state = slots * request_state_bytes(cfg, L.speculative) / L.pp
    kv_pool = hbm - sum(weights.values()) - reserve - scratch - state
    kv = kv_bytes_per_token(cfg, L.kv_cache_dtype)
    per_tok = pool_bytes_per_token(
        cfg, L.kv_cache_dtype, speculative=L.speculative, swa_ratio=L.swa_full_tokens_ratio
    )
    per_tok_gpu = per_tok["per_token"] / L.pp
    max_tokens = max(0, int(kv_pool // per_tok_gpu)) if kv_pool > 0 else 0
    swa_tokens = int(max_tokens * L.swa_full_tokens_ratio)
    reasons: list[str] = []
    notes: list[str] = []
    fixed = sum(weights.values()) + reserve + scratch + state
    if kv_pool <= 0:
        reasons.append(
            f"weights {sum(weights.values()) / GB:.1f} GB + reserve {reserve / GB:.1f} GB + prefill scratch "
            f"{scratch / GB:.1f} GB + request state {state / GB:.1f} GB = {fixed / GB:.1f} GB exceed the "
            f"{L.gpu.memory_gb:g} GB of one {L.gpu.label}"
        )
    elif kv_pool < KV_SHARE_MIN * hbm:
        reasons.append(
            f"the KV pool gets {kv_pool / GB:.1f} GB = {kv_pool / hbm:.0%} of each GPU, below the sizing rule "
            f"({KV_SHARE_MIN:.0%}): weights take {sum(weights.values()) / hbm:.0%} of the card"
        )
    need = math.ceil(L.context_length / max(1, L.attn_cp))
    if kv_pool > 0 and max_tokens < need:
        reasons.append(
            f"the KV pool holds {max_tokens:,} tokens per rank, less than one {L.context_length:,}-token context"
        )
    if L.attn_tp > 0 and cfg.o_groups % L.attn_tp:
        reasons.append(f"attention TP {L.attn_tp} does not divide the {cfg.o_groups} HCA output groups")
    if L.num_gpus != L.nodes * L.gpus_per_node:
        reasons.append(f"tp x pp x dp = {L.num_gpus} GPUs but the cell has {L.nodes} x {L.gpus_per_node}")
    fits = not reasons
    if fits and L.max_running_requests:
        at_full = max_tokens * L.attn_cp // max(1, L.context_length)
        per_rank = L.requests_per_rank
        if at_full < per_rank:
            notes.append(
                f"{per_rank} running requests per rank can each reach "
                f"{max_tokens * L.attn_cp // per_rank:,} tokens at once; only {at_full} can hold the full "
                f"{L.context_length:,} context (SGLang queues or retracts the rest)"
            )
        page_tokens = 2 * SERVING_PAGE_SIZE  # a decode request's window straddles at most 2 pages
        if swa_tokens < per_rank * page_tokens:
            notes.append(
                f"the SWA pool ({swa_tokens:,} tokens) holds the window of {swa_tokens // page_tokens} decoding "
                f"requests per rank, fewer than {per_rank}: raise --swa-full-tokens-ratio"
            )
    if L.hicache_ratio:
        notes.append(
            f"HiCache adds a host pool of {L.hicache_ratio:g}x the GPU KV pool ({L.hicache_ratio * kv_pool / GB:.0f} GB host RAM per GPU)"
        )
    return Plan(
        L,
        weights,
        reserve,
        scratch,
        state,
        kv_pool,
        kv,
        per_tok,
        max_tokens,
        max_tokens * L.kv_ranks * L.attn_cp,
        swa_tokens,
        fits,
        reasons,
        notes,
    )


def minimum_gpus(cfg, gpu: Gpu, precision: str, **kw: Any) -> tuple[int, Plan]:
    """Smallest GPU count (1, 2, 4, 8, 16, 32) whose minimal layout fits; with its plan."""
    last = None
    for n in CANDIDATE_GPU_COUNTS:
        last = plan(cfg, Layout.minimal(gpu, precision, n, **kw))
        if last.fits:
            return n, last
    raise ValueError(f"{precision} does not fit on {CANDIDATE_GPU_COUNTS[-1]} x {gpu.label}: {last.reasons}")


def minimum_gpu_table(cfg) -> dict[tuple[str, str], int]:
    return {(g, p): minimum_gpus(cfg, GPUS[g], p)[0] for g in GPUS for p in ("fp8", "bf16")}
