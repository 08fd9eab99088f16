"""HiCache for the ERNIE-5.5 pools: host mirrors of the paged buffers and the stack strategy that builds them.

`mirrored_regions` names what is mirrored (whole 256-token pages of the HCA window, compressed, MLA latent and
indexer buffers, and the ECHO draft's rows); `Ernie55PagedHostPool` holds one region on the host;
`Ernie55HiCacheStrategy` assembles them under SGLang's hybrid cache controller (docs/kv-layout.md, "HiCache").
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, SidecarPoolSpec
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import StackBuildResult, StackStrategy
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool

from .draft_pool import EchoDraftKVPool
from .pd_layout import page_rows
from .pool import Ernie55TokenToKVPool

logger = logging.getLogger(__name__)
HICACHE_LOG = "ERNIE-5.5 HiCache:"

# SGLang's host-pool names are a closed enum (storage keys, metrics); each region takes the name of the
# DeepSeek-V4 buffer with the same role: uncompressed KV at full slots is "c1", the 1:128 compressed KV "c128",
# sparse-indexer keys "indexer", window rows at SWA slots "swa".
POOL_NAMES = {
    "latent": PoolName.DEEPSEEK_V4_C1,
    "compressed": PoolName.DEEPSEEK_V4_C128,
    "index": PoolName.INDEXER,
}
WINDOW_HYBRID, WINDOW_FULL = PoolName.SWA, PoolName.DEEPSEEK_V4_C2
DRAFT_HYBRID, DRAFT_FULL = PoolName.DRAFT_SWA, PoolName.DRAFT


@dataclasses.dataclass(frozen=True)
class Region:
    """One buffer kind mirrored on the host: per-layer device tensors viewed as `[pages, page_bytes]` uint8
    rows, page p holding full-pool page p (`addressing` "full") or SWA page p ("swa"). `layers` are the model
    layer ids of `pages`, in order."""

    name: str
    pool_name: PoolName
    layers: tuple[int, ...]
    pages: tuple[torch.Tensor, ...]
    addressing: str

    @property
    def page_bytes(self) -> int:
        return self.pages[0].shape[1]


def mirrored_regions(pool: Ernie55TokenToKVPool, draft: EchoDraftKVPool | None = None) -> list[Region]:
    """Every buffer HiCache mirrors, in one page addressing each. The window rows (and the ECHO draft's) follow
    SGLang's SWA slots in hybrid mode, full slots otherwise; compressed entries, latents and indexer keys are
    full-slot addressed (compressed page p = the two blocks of full page p). The open-block state is not
    mirrored: a prefix hit ends on a page boundary, a multiple of the compression block, so the request resumes
    with no open block and never reads the state of the tokens it did not compute."""
    P, ratio = pool.page_size, pool.ratio
    window = "swa" if pool.is_hybrid_swa else "full"
    stores = (
        ("window", pool.win, P, WINDOW_HYBRID if pool.is_hybrid_swa else WINDOW_FULL, window),
        ("compressed", pool.cmp, P // ratio, POOL_NAMES["compressed"], "full"),
        ("latent", pool.latent, P, POOL_NAMES["latent"], "full"),
        ("index", pool.index_k, P, POOL_NAMES["index"], "full"),
    )
    out = []
    for name, store, rows_per_page, pool_name, addressing in stores:
        if store:
            layers = tuple(sorted(store))
            pages = tuple(page_rows(store[lid], rows_per_page) for lid in layers)
            out.append(Region(name, pool_name, layers, pages, addressing))
    if draft is not None:
        out.append(
            Region(
                "draft",
                DRAFT_HYBRID if pool.is_hybrid_swa else DRAFT_FULL,
                (draft.layer_id,),
                (page_rows(draft.rows, P),),
                window,
            )
        )
    return out


class Ernie55PagedHostPool(DeepSeekV4PagedHostPool):
    """Host mirror of one `Region`: `num_host_pages` pages per layer, whole pages only (a token of the fp8
    layouts is not one byte range of its page). Indices are token slots, `slot_page_size` per page, as SGLang's
    controller hands them out. On CUDA the copies are SGLang's own (`kernel` / `direct` io backends over page
    rows); on a CPU server sgl-kernel's transfer ops do not load (they need the CUDA driver), so the same page
    rows move with torch `index_select` / `index_copy_`, in every host layout."""

    def __init__(
        self, region: Region, num_host_pages: int, slot_page_size: int, layout: str, allocator_type: str
    ):
        self.region = region
        self.torch_io = region.pages[0].device.type == "cpu"
        super().__init__(
            pool_name=f"ernie55_{region.name}",
            device_buffers=list(region.pages),
            item_bytes=region.page_bytes,
            num_host_pages=num_host_pages,
            slot_page_size=slot_page_size,
            layout=layout,
            allocator_type=allocator_type,
            # pinned host memory needs the CUDA runtime
            pin_memory=not self.torch_io,
            page_aligned_only=True,
        )

    def _host_layer(self, layer: int) -> torch.Tensor:
        """The host pages of one layer, `[num_host_pages, page_bytes]` (a view into the host buffer)."""
        if self.layout == "layer_first":
            return self.kv_buffer[layer]
        if self.layout == "page_first":
            return self.kv_buffer[:, layer, :]
        if self.layout == "page_first_direct":
            return self.kv_buffer[:, layer, 0, :]
        raise ValueError(f"{self.pool_name}: unsupported host layout {self.layout!r}")

    def _page_rows(self, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """Token slots -> (host page rows, device page rows); every run of `slot_page_size` slots must be one
        whole page in order, as SGLang's paged allocators hand them out."""
        P = self.slot_page_size
        rows = []
        for indices in (host_indices, device_indices):
            idx = indices.to(device="cpu", dtype=torch.int64)
            if idx.numel() % P:
                raise self._unaligned_transfer_error(host_indices, device_indices)
            pages = idx.view(-1, P)
            if bool((pages[:, 0] % P).any()) or not torch.equal(
                pages - pages[:, :1], torch.arange(P).expand_as(pages)
            ):
                raise ValueError(f"{self.pool_name}: transfer slots are not whole pages of {P}")
            rows.append(pages[:, 0] // P)
        return rows

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        if not self.torch_io:
            return super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        if not self._has_transfer_indices(host_indices, device_indices):
            return
        host_rows, device_rows = self._page_rows(host_indices, device_indices)
        for layer, device_pages in enumerate(self.device_buffers):
            self._host_layer(layer).index_copy_(0, host_rows, device_pages.index_select(0, device_rows))

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft: bool = False
    ):
        if not self.torch_io:
            return super().load_to_device_per_layer(
                device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft
            )
        if not self._has_transfer_indices(host_indices, device_indices):
            return
        host_rows, device_rows = self._page_rows(host_indices, device_indices)
        self.device_buffers[layer_id].index_copy_(
            0, device_rows, self._host_layer(layer_id).index_select(0, host_rows)
        )


def host_page_counts(pool: Ernie55TokenToKVPool, ratio: float) -> tuple[int, int]:
    """(full, SWA) host pages for `--hicache-ratio`: that multiple of the device pool's pages (its padding page
    left out); the SWA count is the full one without an SWA pool."""
    P = pool.page_size
    full = int(pool.size // P * ratio)
    swa = int(pool.swa_size // P * ratio) if pool.is_hybrid_swa else full
    if full < 1 or swa < 1:
        raise ValueError(
            f"ERNIE-5.5 HiCache: --hicache-ratio {ratio} leaves the host pool no page "
            f"({pool.size} full / {pool.swa_size} SWA device tokens of {P} per page); raise it (e.g. 2)"
        )
    return full, swa


def _evict_swa_for_device_alloc(cache, need: int) -> None:
    """Make room on the device SWA pool for a load of `need` SWA slots (SGLang's SWA eviction)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    short = need - cache.token_to_kv_pool_allocator.swa_available_size()
    if short > 0:
        cache.evict_for_alloc(EvictParams(swa_num_tokens=short))


def _draft_pool(params) -> EchoDraftKVPool | None:
    """The ECHO draft pool when the server speculates (SGLang hands it over as the packed MTP draft, since the
    draft has one `nextn` layer), else None."""
    pools = tuple(params.mtp_draft_device_pools)
    drafts = [p for p in pools if isinstance(p, EchoDraftKVPool)]
    if len(drafts) != len(pools) or len(drafts) > 1:
        raise NotImplementedError(
            f"ERNIE-5.5 HiCache mirrors one ECHO draft pool; SGLang passed {[type(p).__name__ for p in pools]}"
        )
    return drafts[0] if drafts else None


class Ernie55HiCacheStrategy(StackStrategy):
    """SGLang's HiCache stack for `Ernie55TokenToKVPool` (hybrid SWA: FULL + SWA tree components; without an
    SWA pool: FULL only). A logical anchor carries the full-pool host slots (no bytes of its own, like
    DeepSeek-V4's); every region is an `Ernie55PagedHostPool` whose indices come from the anchor (full-slot
    regions) or from the SWA component (window rows and the ECHO draft's rows in hybrid mode)."""

    def matches(self, kvcache, components) -> bool:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        if not isinstance(kvcache, Ernie55TokenToKVPool):
            return False
        want = {ComponentType.FULL, ComponentType.SWA} if kvcache.is_hybrid_swa else {ComponentType.FULL}
        return set(components) == want

    def build(
        self,
        *,
        cache,
        kvcache,
        params,
        server_args,
        load_cache_event,
        storage_backend=None,
        storage_backend_extra_config=None,
        prefetch_threshold=256,
        model_name=None,
        enable_storage_metrics=False,
    ) -> StackBuildResult:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host.common import get_allocator_type
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        P, layout = params.page_size, memory.hicache_mem_layout
        full_pages, swa_pages = host_page_counts(kvcache, memory.hicache_ratio)
        layer_ids = (
            kvcache.layer_num
        )  # controller transfer ids are the model's layer ids (no pipeline stages)
        hybrid = kvcache.is_hybrid_swa
        entries = [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=LogicalHostPool(full_pages * P, P, layout=layout),
                device_pool=kvcache,
                layer_mapping={i: i for i in range(layer_ids)},
                transfer_layer_id_max=layer_ids,
                is_anchor=True,
            )
        ]
        sidecars, host_bytes, io = [], 0, memory.hicache_io_backend
        for region in mirrored_regions(kvcache, _draft_pool(params)):
            swa = region.addressing == "swa"
            host = Ernie55PagedHostPool(
                region, swa_pages if swa else full_pages, P, layout, get_allocator_type()
            )
            host_bytes += host.layer_num * host.num_host_pages * host.item_bytes
            io = "torch" if host.torch_io else io
            # the draft's rows load with the first layer's: the draft runs after the whole target forward
            mapping = {0: 0} if region.name == "draft" else {lid: i for i, lid in enumerate(region.layers)}
            extra = {}
            if region.pool_name == WINDOW_HYBRID:
                allocator = params.token_to_kv_pool_allocator.swa_attn_allocator
                extra = dict(
                    host_evict_fn=lambda n: cache.evict_host(n, ComponentType.SWA),
                    device_evict_fn=lambda n: _evict_swa_for_device_alloc(cache, n),
                    device_alloc_fn=allocator.alloc,
                    device_free_fn=allocator.free,
                )
            else:
                # full-slot regions take the anchor's indices; the hybrid draft takes the window's
                source = WINDOW_HYBRID if swa else PoolName.KV
                policy = PoolHitPolicy.TRAILING_PAGES if swa else PoolHitPolicy.ALL_PAGES
                sidecars.append(
                    SidecarPoolSpec(region.pool_name, indices_from_pool=source, hit_policy=policy)
                )
            entries.append(
                build_pool_entry(
                    name=region.pool_name,
                    host_pool=host,
                    device_pool=kvcache,
                    layer_mapping=mapping,
                    transfer_layer_id_max=layer_ids,
                    **extra,
                )
            )
        group = HostPoolGroup(entries)
        controller = HybridCacheController(
            params.token_to_kv_pool_allocator,
            group,
            P,
            params.tp_cache_group,
            load_cache_event=load_cache_event,
            attn_cp_group=params.attn_cp_cache_group,
            attn_tp_group=params.attn_tp_cache_group,
            pp_group=params.pp_cache_group,
            write_policy=memory.hicache_write_policy,
            io_backend=memory.hicache_io_backend,
            storage_backend=storage_backend,
            prefetch_threshold=prefetch_threshold,
            model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config,
            transfer_layer_id_max=layer_ids,
            enable_storage_metrics=enable_storage_metrics,
            host_memory_mode=memory.hicache_host_memory_mode,
        )
        names = [e.name.value for e in entries]
        logger.info(
            f"{HICACHE_LOG} host pools {'+'.join(names)}: {full_pages} full pages"
            + (f", {swa_pages} SWA pages" if hybrid else "")
            + f" (--hicache-ratio {memory.hicache_ratio:g}), {host_bytes / (1 << 30):.3f} GiB, layout={layout}, "
            f"io={io}"
        )
        host_pools = {ComponentType.FULL: group.get_pool(PoolName.KV)}
        if hybrid:
            host_pools[ComponentType.SWA] = group.get_pool(WINDOW_HYBRID)
        return StackBuildResult(
            host_pool_group=group,
            cache_controller=controller,
            component_host_pools=host_pools,
            sidecars=sidecars,
            pools_desc=" + ".join(n.upper() for n in names),
            # every region is assembled above; SGLang's declaration check would ask the pool for MHA / MLA ones
            pool_declarations=(),
        )
