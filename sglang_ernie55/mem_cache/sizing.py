"""KV-pool sizing of ERNIE-5.5: the one buffer list the pools allocate and the configurator sizes from.

`PoolLayout.buffers(full, swa, req_slots)` lists every tensor of `Ernie55TokenToKVPool` (and of the ECHO
draft pool when speculating); the pools allocate exactly that list, and `Ernie55PoolConfigurator` picks the
largest full-pool token count whose buffers, plus what SGLang allocates alongside them for that count (the
request-to-token table, the SWA allocator's index map and free lists), fit the byte budget SGLang measured.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..configuration import LAYER_HCA, SERVING_PAGE_SIZE
from ..kernels.layout import (
    HCA_STATE_BLOCKS,
    HCA_STATE_BLOCKS_SPEC,
    Geometry,
    hca_geometry,
    idx_geometry,
    mla_geometry,
)

logger = logging.getLogger(__name__)

FP8_KV = "fp8_e4m3"
BF16_KV = "bfloat16"
DENSE_KV = "float32"  # exactness tests only: unquantised rows, never what --kv-cache-dtype selects
KV_DTYPES = (FP8_KV, BF16_KV)
SIZING_LOG = "ERNIE-5.5 pool sizing:"
# The CUDA caching allocator rounds every large block up to 2 MiB: charged once per buffer.
ALLOC_ROUNDING = 2 << 20
# SGLang's write-back staging chunk of a `page_first` HiCache host pool, in pages (pool_host.base)
HICACHE_STAGING_PAGES = 64


def normalize_kv_dtype(name) -> str:
    """SGLang's `--kv-cache-dtype` value (or torch dtype) -> fp8_e4m3 | bfloat16 | float32 (dense test pools)."""
    n = str(name).replace("torch.", "")
    if n in ("fp8_e4m3", "float8_e4m3fn", "uint8"):
        return FP8_KV
    if n in ("bfloat16", "bf16"):
        return BF16_KV
    if n == "float32":
        return DENSE_KV
    raise ValueError(f"ERNIE-5.5 KV cache dtype must be fp8_e4m3 or bfloat16, got {name!r}")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One tensor of a pool: `rows` token rows in a packed layout (`geom`: [pages, page_bytes] uint8), or
    `shape` of `dtype` (dense rows, the open-block state)."""

    name: str
    layer: int
    rows: int
    geom: Geometry | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.uint8

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        if self.geom is not None:
            return (-(-self.rows // self.geom.page_size), self.geom.page_bytes)
        return self.shape

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.tensor_shape:
            n *= d
        return n * (1 if self.geom is not None else torch.empty((), dtype=self.dtype).element_size())

    def alloc(self, device) -> torch.Tensor:
        return torch.zeros(
            self.tensor_shape, dtype=torch.uint8 if self.geom is not None else self.dtype, device=device
        )


class PoolLayout:
    """The buffers of the ERNIE-5.5 pools at one geometry (config, KV dtype, page size, open-block state ring,
    ECHO draft or not), and their bytes per token for the planner."""

    def __init__(
        self,
        config,
        kv_dtype,
        page_size: int = SERVING_PAGE_SIZE,
        state_blocks: int = HCA_STATE_BLOCKS,
        echo: bool = False,
    ):
        if state_blocks not in (HCA_STATE_BLOCKS, HCA_STATE_BLOCKS_SPEC):
            raise ValueError(
                f"state_blocks must be {HCA_STATE_BLOCKS} or {HCA_STATE_BLOCKS_SPEC} (speculative), "
                f"got {state_blocks}"
            )
        c = config
        if page_size % c.compress_ratio:
            raise ValueError(f"page size {page_size} must be a multiple of compress_ratio {c.compress_ratio}")
        self.config, self.kv, self.page_size, self.state_blocks = (
            c,
            normalize_kv_dtype(kv_dtype),
            page_size,
            state_blocks,
        )
        self.ratio, self.echo = c.compress_ratio, echo
        self.hca = [i for i, t in enumerate(c.layer_types) if t == LAYER_HCA]
        self.mla = [i for i, t in enumerate(c.layer_types) if t != LAYER_HCA]
        self.n_hca, self.n_mla = len(self.hca), len(self.mla)
        D, r, R, dI = c.head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.index_head_dim
        self.widths = {
            "window": D,
            "compressed": D,
            "latent": R + r,
            "index": dI,
            "draft": D if c.layer_types[-1] == LAYER_HCA else R + r,
        }
        # geometries of the layer kinds present only: an fp8 layout that cannot tile an absent kind's widths
        # (an HCA-only checkpoint's unused kv_lora_rank) must not refuse the pool
        self.geoms: dict = dict.fromkeys(self.widths)
        if self.kv != DENSE_KV:
            kv, cmp_page = self.kv, page_size // self.ratio
            if self.hca:
                self.geoms["window"] = hca_geometry(kv, D, r, page_size)
                self.geoms["compressed"] = hca_geometry(kv, D, r, cmp_page)
            if self.mla:
                self.geoms["latent"] = mla_geometry(kv, R, r, page_size)
                self.geoms["index"] = idx_geometry(kv, dI, page_size)
            self.geoms["draft"] = self.geoms["window" if c.layer_types[-1] == LAYER_HCA else "latent"]
        self.state_ring = state_blocks * self.ratio
        self.state_width = 2 * D

    # ------------------------------------------------------------------ rows
    def token_rows(self, full: int) -> int:
        return full + self.page_size  # + SGLang's padding page

    def window_rows(self, full: int, swa: int | None) -> int:
        return (full if swa is None else swa) + self.page_size

    def cmp_rows(self, full: int) -> int:
        """Compressed entries: one per block of the full pool, + one scratch entry (padded CUDA-graph rows write
        there), rounded up to whole compressed pages."""
        cmp_page = self.page_size // self.ratio
        return -(-(self.token_rows(full) // self.ratio + 1) // cmp_page) * cmp_page

    def _rows(self, name: str, layer: int, rows: int) -> Buffer:
        g = self.geoms[name]
        if g is None:
            return Buffer(name, layer, rows, shape=(rows, self.widths[name]), dtype=torch.float32)
        return Buffer(name, layer, rows, geom=g)

    def buffers(self, full: int, swa: int | None, req_slots: int) -> list[Buffer]:
        """The target pool's tensors for `full` full-pool tokens, `swa` SWA tokens (None: no SWA pool, the
        window rows at every full slot) and `req_slots` request slots (+ one scratch slot of state)."""
        out = []
        for lid in self.hca:
            out.append(self._rows("window", lid, self.window_rows(full, swa)))
            out.append(self._rows("compressed", lid, self.cmp_rows(full)))
            out.append(
                Buffer(
                    "state",
                    lid,
                    req_slots + 1,
                    shape=(req_slots + 1, self.state_ring, self.state_width),
                    dtype=torch.float32,
                )
            )
        for lid in self.mla:
            out.append(self._rows("latent", lid, self.token_rows(full)))
            out.append(self._rows("index", lid, self.token_rows(full)))
        return out

    def draft_buffers(self, full: int, swa: int | None) -> list[Buffer]:
        """The ECHO draft pool: the last layer's window rows, at the target's window addressing."""
        return [self._rows("draft", self.config.num_hidden_layers - 1, self.window_rows(full, swa))]

    def allocated(self, full: int, swa: int | None, req_slots: int) -> int:
        """Bytes of the target pool (and the draft pool when `echo`)."""
        bufs = self.buffers(full, swa, req_slots) + (self.draft_buffers(full, swa) if self.echo else [])
        return sum(b.nbytes for b in bufs)

    def num_buffers(self) -> int:
        return 3 * self.n_hca + 2 * self.n_mla + int(self.echo)

    def hicache_staging_bytes(self, full: int, swa: int | None, ratio: float) -> int:
        """Device bytes of SGLang's write-back staging buffers under HiCache's `page_first` host layout on CUDA:
        each host pool (one per buffer kind, docs/kv-layout.md "HiCache") stages min(its host pages,
        HICACHE_STAGING_PAGES) pages of every layer; built with the radix cache, after the KV pool. The
        open-block state has no host pool."""
        bufs = self.buffers(full, swa, 0) + (self.draft_buffers(full, swa) if self.echo else [])
        full_pages = int(full // self.page_size * ratio)
        swa_pages = full_pages if swa is None else int(swa // self.page_size * ratio)
        total = 0
        for b in bufs:
            if b.name == "state" or b.geom is None:
                continue
            pages = swa_pages if b.name in ("window", "draft") else full_pages
            total += min(pages, HICACHE_STAGING_PAGES) * b.geom.page_bytes
        return total

    # ------------------------------------------------------------------ bytes per token (planner, logs)
    def _per_token(self, name: str) -> float:
        g = self.geoms[name]
        if g is None and self.kv != DENSE_KV:
            return 0.0  # a layer kind this checkpoint does not have
        return 4.0 * self.widths[name] if g is None else g.page_bytes / g.page_size

    @property
    def window_row(self) -> float:
        return self._per_token("window")

    @property
    def cmp_row(self) -> float:
        return self._per_token("compressed")

    @property
    def latent_row(self) -> float:
        return self._per_token("latent")

    @property
    def index_row(self) -> float:
        return self._per_token("index")

    @property
    def draft_row(self) -> float:
        return self._per_token("draft") if self.echo else 0.0

    @property
    def state_per_slot(self) -> int:
        return self.n_hca * self.state_ring * self.state_width * 4

    def per_swa_token(self) -> float:
        return self.n_hca * self.window_row + self.draft_row

    def per_full_token(self, swa_ratio: float = 1.0) -> float:
        return (
            swa_ratio * self.per_swa_token()
            + self.n_hca * self.cmp_row / self.ratio
            + self.n_mla * (self.latent_row + self.index_row)
        )


def device_memory(device) -> str:
    """One log fragment of the CUDA device's memory ('' elsewhere): what PyTorch holds and what is free, so
    that a log shows where memory went between the pool sizing and graph capture."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    gib = 1 << 30
    return (
        f"torch allocated {torch.cuda.memory_allocated() / gib:.2f} GiB, reserved "
        f"{torch.cuda.memory_reserved() / gib:.2f} GiB, device free {free / gib:.2f} of {total / gib:.2f} GiB"
    )


def state_blocks_for(spec_algorithm) -> int:
    """Blocks of the HCA open-block state ring: 2 when the server verifies speculative drafts (any SGLang
    `SpeculativeAlgorithm` other than NONE), else 1."""
    speculative = spec_algorithm is not None and not spec_algorithm.is_none()
    return HCA_STATE_BLOCKS_SPEC if speculative else HCA_STATE_BLOCKS


def kv_bytes(
    config, kv_dtype, page_size: int = SERVING_PAGE_SIZE, echo: bool = False, state_blocks: int = 1
) -> PoolLayout:
    """The pools' layout at this config (the planner's and the configurator's bytes per token)."""
    return PoolLayout(config, kv_dtype, page_size, state_blocks, echo)


def swa_tokens_for(full_tokens: int, swa_ratio: float, page_size: int) -> int:
    """SGLang's rule (HybridSWAPoolConfigurator / DSV4PoolConfigurator ratio mode): whole pages of the ratio."""
    return int(full_tokens * swa_ratio) // page_size * page_size


def swa_prefix_hit_floor(window: int, page_size: int) -> int:
    """The smallest SWA pool (tokens) in which SGLang 0.5.23 admits a prefix hit on an idle server: its admission
    (`mem_cache/prefill_budget.py`) needs free + evictable SWA rows, the hit's window pages pinned, strictly above
    `estimate_swa_kv_tokens` of the one-page resume (tail past the window + the window + a page). A smaller pool
    serves every request once and queues a repeated prompt until its client gives up."""
    pages = lambda n: -(-n // page_size) * page_size  # noqa: E731
    resume = max(page_size - window, 0) + window + page_size
    return resume + pages(window) + page_size


@dataclasses.dataclass(frozen=True)
class SGLangSide:
    """What SGLang allocates on the device next to our pools, for a given pool size (kv_cache_configurator):
    the request-to-token table ([max requests + 1 (+ PD decode slots), context + headroom] int32), the SWA
    allocator's full->SWA index map ([full + page + 1] int64) and the paged allocators' free-page lists."""

    context_len: int  # model context length + SGLang's row headroom
    extra_req_slots: int  # PD decode pre-allocated slots
    hybrid: bool
    page_size: int

    def req_to_token_bytes(self, max_reqs: int) -> int:
        return (max_reqs + self.extra_req_slots + 1) * self.context_len * 4

    def allocator_bytes(self, full: int, swa: int | None) -> int:
        pages = full // self.page_size + (swa // self.page_size if swa is not None else 0)
        mapping = (full + self.page_size + 1) if self.hybrid else 0
        return 8 * (mapping + pages)


def eager_input_bytes_per_token() -> float:
    """Device bytes SGLang's `EagerRunner` keeps per token of its static input buffers (input ids, positions,
    cache locations, mrope positions), which it sizes to the KV pool's token count: SGLang's own slot list,
    measured on the meta device (48 B in 0.5.23; 12% of the tiny model's KV bytes per token)."""
    from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry

    def total(n: int) -> int:
        reg = build_decode_registry(
            device=torch.device("meta"),
            max_bs=1,
            max_num_token=n,
            seq_len_fill_value=0,
            cache_loc_dtype=torch.int64,
            enable_num_token_non_padded=False,
            register_global_num_tokens=False,
            require_gathered_buffer=False,
            require_mlp_tp_gather=False,
            num_dp_ranks=1,
            share_pool=False,
            source=None,
        )
        bufs = [reg.get_slot(name).buffer for name in reg.slot_names()]
        return sum(b.numel() * b.element_size() for b in bufs if b is not None and b.device.type == "meta")

    return (total(2048) - total(1024)) / 1024


def fit_full_tokens(budget: int, cost, page_size: int) -> int:
    """Largest page-aligned full-pool token count n >= 0 with cost(n) <= budget (cost increasing in n)."""
    if cost(0) > budget:
        return 0
    lo, hi = 0, page_size
    while cost(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > page_size:
        mid = (lo + hi) // 2 // page_size * page_size
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
    return lo


def _hicache_staging_ratio() -> float | None:
    """`--hicache-ratio` when the server runs HiCache with the `page_first` host layout (SGLang's default),
    whose host pools keep a write-back staging buffer on the device; else None."""
    from sglang.srt.runtime_context import get_memory

    memory = get_memory()
    if not memory.enable_hierarchical_cache or memory.hicache_mem_layout != "page_first":
        return None
    return float(memory.hicache_ratio)


def _make_configurator():
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator
    from sglang.srt.runtime_context import get_disagg, get_schedule, max_prefill_buffer_tokens

    class Ernie55PoolConfigurator(MemoryPoolConfigurator):
        """Sizes `Ernie55TokenToKVPool` (+ the ECHO draft pool): full + SWA token counts in hybrid mode (SGLang's
        `SWATokenToKVPoolAllocator` and SWA radix cache), one token count without an SWA pool."""

        def __init__(self, kvc):
            spec = getattr(kvc, "spec_algorithm", None)
            speculating = spec is not None and not spec.is_none() and not kvc.is_draft_worker
            kv = kvc.kv_cache_dtype_str or str(kvc.kv_cache_dtype)
            self.layout = PoolLayout(
                kvc.model_config.hf_config, kv, echo=speculating, state_blocks=state_blocks_for(spec)
            )
            self.hybrid = bool(kvc.is_hybrid_swa)
            self.swa_ratio = float(get_schedule().swa_full_tokens_ratio) if self.hybrid else 1.0
            self.sliding_window_size = kvc.sliding_window_size
            # the CUDA caching allocator's rounding, per buffer (none on CPU)
            self.rounding = ALLOC_ROUNDING if str(getattr(kvc, "device", "cpu")).startswith("cuda") else 0
            self.max_reqs = kvc.resolve_max_num_reqs  # SGLang's rule, from the pool's token count
            # HiCache's page_first host pools stage write-backs on the device (CUDA only), after the KV pool
            self.hicache_ratio = _hicache_staging_ratio() if self.rounding else None
            self.eager_per_token = eager_input_bytes_per_token()
            disagg = get_disagg()
            decode = disagg.disaggregation_mode == "decode" or getattr(disagg, "enable_pd_role_switch", False)
            self.sglang = SGLangSide(
                context_len=kvc.model_config.context_len + get_req_to_token_extra_context_len(),
                extra_req_slots=(disagg.disaggregation_decode_extra_slots or 0) if decode else 0,
                hybrid=self.hybrid,
                page_size=SERVING_PAGE_SIZE,
            )

        def _swa(self, full: int, page_size: int) -> int | None:
            return swa_tokens_for(full, self.swa_ratio, page_size) if self.hybrid else None

        def planned_bytes(self, full: int, page_size: int) -> dict[str, int]:
            """Device bytes a pool of `full` tokens brings with it, by owner."""
            swa = self._swa(full, page_size)
            reqs = self._quiet_max_reqs(max(full, page_size))
            return {
                "pool": self.layout.allocated(full, swa, reqs + self.sglang.extra_req_slots + 1),
                "req_to_token": self.sglang.req_to_token_bytes(reqs),
                "allocator": self.sglang.allocator_bytes(full, swa),
                # SGLang's eager runner sizes its static inputs to max(pool tokens, prefill chunk)
                "eager_inputs": int(self.eager_per_token * max(full, max_prefill_buffer_tokens())),
                "rounding": self.rounding * (self.layout.num_buffers() + 3),
                "hicache_staging": (
                    self.layout.hicache_staging_bytes(full, swa, self.hicache_ratio)
                    if self.hicache_ratio
                    else 0
                ),
            }

        def _quiet_max_reqs(self, full: int) -> int:
            """SGLang's max requests for a pool of `full` tokens, without its warning about a user cap that
            does not fit (sizing probes small pools on the way)."""
            log = logging.getLogger("sglang.srt.mem_cache.kv_cache_configurator")
            level = log.level
            log.setLevel(logging.ERROR)
            try:
                return int(self.max_reqs(full))
            finally:
                log.setLevel(level)

        def _config(self, full: int, page_size: int, source: str, budget: int | None = None):
            full = full // page_size * page_size
            plan = self.planned_bytes(full, page_size)
            swa = self._swa(full, page_size)
            gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
            parts = " ".join(f"{k}={gib(v)}" for k, v in plan.items())
            head = f"{SIZING_LOG} mode={'hybrid-swa' if self.hybrid else 'full-only'} ({source})"
            logger.info(
                f"{head} full_tokens={full} swa_tokens={swa} swa_full_tokens_ratio={self.swa_ratio} "
                f"bytes_per_full_token={self.layout.per_full_token(self.swa_ratio if self.hybrid else 1.0):.1f} "
                f"bytes_per_swa_token={self.layout.per_swa_token():.1f} planned={gib(sum(plan.values()))} ({parts})"
                + (f" budget={gib(budget)}" if budget is not None else "")
            )
            if budget is not None and plan["req_to_token"] > budget // 4:
                logger.warning(
                    f"{SIZING_LOG} SGLang's request-to-token table ({self._quiet_max_reqs(max(full, page_size))} "
                    f"requests x {self.sglang.context_len} positions) takes {gib(plan['req_to_token'])}, "
                    f"{plan['req_to_token'] / budget:.0%} of the KV budget; a shorter --context-length or a lower "
                    "--max-running-requests leaves it to the KV pool"
                )
            if not self.hybrid:
                return MemoryPoolConfig(max_total_num_tokens=full)
            self.validate_swa_pool_size(swa, self.sliding_window_size, page_size)
            floor = swa_prefix_hit_floor(self.sliding_window_size or 0, page_size)
            if swa < floor:
                logger.warning(
                    f"{SIZING_LOG} the SWA pool of {swa} tokens ({swa // page_size} pages) is below "
                    f"{floor} ({floor // page_size} pages): SGLang never admits a prefix-cache hit into it, so a "
                    "repeated prompt waits in the queue. Raise --swa-full-tokens-ratio (now "
                    f"{self.swa_ratio}) or the pool (--max-total-tokens {full}, --mem-fraction-static) until "
                    f"ratio x full tokens >= {floor}"
                )
            return MemoryPoolConfig(
                max_total_num_tokens=full, full_max_total_num_tokens=full, swa_max_total_num_tokens=swa
            )

        def calculate_pool_sizes(self, available_bytes, page_size):
            self.sglang = dataclasses.replace(self.sglang, page_size=page_size)
            full = fit_full_tokens(
                available_bytes, lambda n: sum(self.planned_bytes(n, page_size).values()), page_size
            )
            self._check_room(full, page_size, available_bytes)
            return self._config(full, page_size, "memory budget", available_bytes)

        def _check_room(self, full: int, page_size: int, budget: int) -> None:
            """A budget that leaves no usable pool: say what took it (SGLang's own message would blame the SWA
            ratio or the memory fraction, while the request table of a long context is the usual cause)."""
            swa = self._swa(full, page_size)
            floor = (self.sliding_window_size or 0) + page_size
            if full >= 2 * page_size and (swa is None or swa > floor):
                return
            plan = self.planned_bytes(max(full, page_size), page_size)
            if plan["req_to_token"] < budget // 2:
                return  # not the table: SGLang's own checks name the flag (SWA ratio, memory fraction)
            gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
            reqs = self._quiet_max_reqs(max(full, page_size))
            raise RuntimeError(
                f"ERNIE-5.5: the KV budget of {gib(budget)} leaves no usable KV pool: SGLang's request-to-token "
                f"table for {reqs} requests x {self.sglang.context_len} positions takes "
                f"{gib(plan['req_to_token'])}, the pool would get {full} tokens. Lower --context-length (the model "
                f"serves up to {self.layout.config.max_position_embeddings}) or --max-running-requests, or raise "
                f"--mem-fraction-static"
            )

        def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens, page_size):
            self.sglang = dataclasses.replace(self.sglang, page_size=page_size)
            return self._config(max_total_num_tokens, page_size, "token cap")

    return Ernie55PoolConfigurator
