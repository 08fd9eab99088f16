"""ERNIE-5.5 KV pool and its SGLang hooks (patch ledger: docs/hooks.md, section "mem_cache").

`register()` adds two AROUND hooks through SGLang's HookRegistry; both fall through to SGLang for
every architecture other than ERNIE-5.5:

- `sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator`: size the pool with
  `Ernie55PoolConfigurator` (our bytes per token and the fixed open-block state);
- `sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool`: build
  `Ernie55TokenToKVPool` with the SWA pool size when SGLang runs the model as hybrid SWA (the config's
  `is_hybrid_swa` opt-in); SGLang then builds its own `SWATokenToKVPoolAllocator` and SWA radix cache
  around it (without `--disable-hybrid-swa-memory`), or its paged allocator and plain radix cache.
"""

from __future__ import annotations

HOOK_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"
HOOK_BUILD_POOL = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"

_registered = False


def is_ernie55(hf_config) -> bool:
    from ..configuration import ARCHITECTURES

    return any(a in ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or []))


def _around_configurator(original, kvc, *args, **kwargs):
    if not is_ernie55(kvc.model_config.hf_config):
        return original(kvc, *args, **kwargs)
    from .sizing import _make_configurator

    return _make_configurator()(kvc)


def _around_build_pool(original, self, *args, sizes, req_to_token_pool, **kwargs):
    if not is_ernie55(self.model_config.hf_config):
        return original(self, *args, sizes=sizes, req_to_token_pool=req_to_token_pool, **kwargs)
    from sglang.srt.runtime_context import get_exec

    from .pool import Ernie55TokenToKVPool
    from .sizing import state_blocks_for

    if self.is_draft_worker:
        raise NotImplementedError("sglang-ernie55: the ECHO draft's KV pool is a later stage")
    hybrid = bool(self.is_hybrid_swa)
    if hybrid and sizes.full_max_total_num_tokens != sizes.max_total_num_tokens:
        raise ValueError(
            f"ERNIE-5.5 pool: full_max_total_num_tokens {sizes.full_max_total_num_tokens} != "
            f"max_total_num_tokens {sizes.max_total_num_tokens} (Ernie55PoolConfigurator sets both)"
        )
    import logging

    from .sizing import SIZING_LOG, device_memory

    log = logging.getLogger(__name__)
    if device_memory(self.device):
        log.info(f"{SIZING_LOG} before the KV pool: {device_memory(self.device)}")
    pool = Ernie55TokenToKVPool(
        sizes.max_total_num_tokens,
        page_size=self.pool_page_size,
        dtype=self.kv_cache_dtype,
        config=self.model_config.hf_config,
        num_req_slots=req_to_token_pool.req_to_token.shape[0],
        device=self.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        swa_size=sizes.swa_max_total_num_tokens if hybrid else None,
        state_blocks=state_blocks_for(
            getattr(self, "spec_algorithm", None)
        ),  # 2 when speculating (rejected drafts)
    )
    if device_memory(self.device):
        log.info(f"{SIZING_LOG} after the KV pool: {device_memory(self.device)}")
    return pool


def register() -> None:
    """Register the pool hooks (idempotent). Called from the plugin's register()."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_CONFIGURATOR, _around_configurator, HookType.AROUND)
    HookRegistry.register(HOOK_BUILD_POOL, _around_build_pool, HookType.AROUND)
    _registered = True
