"""ERNIE-5.5 KV pools and the two patches that make SGLang size and build them (rows in patches.py).

`around_create_memory_pool_configurator` sizes the pool with `Ernie55PoolConfigurator` (sizing.py);
`around_build_token_to_kv_pool` builds `Ernie55TokenToKVPool` (pool.py) for the target worker and
`EchoDraftKVPool` (draft_pool.py) for the ECHO draft worker. Both fall through to SGLang for every other
architecture; SGLang's own allocator and radix cache then run over our pools unchanged.
"""

from __future__ import annotations

import logging

from ..arch import architecture, is_echo_draft, is_ernie55
from ..configuration import ARCH_ECHO

logger = logging.getLogger(__name__)


def around_create_memory_pool_configurator(original, kvc, *args, **kwargs):
    """AROUND `create_memory_pool_configurator`: our configurator for ERNIE-5.5 (target and draft)."""
    if not is_ernie55(kvc.model_config.hf_config):
        return original(kvc, *args, **kwargs)
    from .sizing import _make_configurator

    return _make_configurator()(kvc)


def around_build_token_to_kv_pool(original, self, *args, sizes, req_to_token_pool, **kwargs):
    """AROUND `KVCacheConfigurator._build_token_to_kv_pool`, one decision for both workers: the ECHO draft
    worker gets `EchoDraftKVPool`, an ERNIE-5.5 target worker `Ernie55TokenToKVPool`, everything else
    SGLang's pool."""
    hf_config = self.model_config.hf_config
    if self.is_draft_worker and is_echo_draft(hf_config):
        return _echo_draft_pool(self, sizes)
    if not is_ernie55(hf_config):
        return original(self, *args, sizes=sizes, req_to_token_pool=req_to_token_pool, **kwargs)
    if self.is_draft_worker:
        raise NotImplementedError(
            f"sglang-ernie55: no KV pool for a {architecture(hf_config)} draft worker (the ERNIE-5.5 draft is "
            f"ECHO, {ARCH_ECHO})"
        )
    return _target_pool(self, sizes, req_to_token_pool)


def _target_pool(kvc, sizes, req_to_token_pool):
    """The target's pool, with the SWA pool size when SGLang runs the model as hybrid SWA (the config's
    `is_hybrid_swa` opt-in; SGLang then registers its allocator's full-to-SWA mapping with the pool)."""
    from sglang.srt.runtime_context import get_exec

    from .pool import Ernie55TokenToKVPool
    from .sizing import SIZING_LOG, device_memory, state_blocks_for

    hybrid = bool(kvc.is_hybrid_swa)
    if hybrid and sizes.full_max_total_num_tokens != sizes.max_total_num_tokens:
        raise ValueError(
            f"ERNIE-5.5 pool: full_max_total_num_tokens {sizes.full_max_total_num_tokens} != "
            f"max_total_num_tokens {sizes.max_total_num_tokens} (Ernie55PoolConfigurator sets both)"
        )
    if device_memory(kvc.device):
        logger.info(f"{SIZING_LOG} before the KV pool: {device_memory(kvc.device)}")
    pool = Ernie55TokenToKVPool(
        sizes.max_total_num_tokens,
        page_size=kvc.pool_page_size,
        dtype=kvc.kv_cache_dtype,
        config=kvc.model_config.hf_config,
        num_req_slots=req_to_token_pool.req_to_token.shape[0],
        device=kvc.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        swa_size=sizes.swa_max_total_num_tokens if hybrid else None,
        # 2 blocks when speculating: a rejected draft must not overwrite the state the next round starts from
        state_blocks=state_blocks_for(getattr(kvc, "spec_algorithm", None)),
    )
    if device_memory(kvc.device):
        logger.info(f"{SIZING_LOG} after the KV pool: {device_memory(kvc.device)}")
    return pool


def _echo_draft_pool(kvc, sizes):
    """The ECHO draft's window rows of one layer; in hybrid SWA at the target allocator's SWA slots (SGLang
    registers that allocator's mapping with this pool too), else at the shared full-pool slots."""
    from sglang.srt.runtime_context import get_exec

    from .draft_pool import EchoDraftKVPool

    return EchoDraftKVPool(
        sizes.max_total_num_tokens,
        page_size=kvc.pool_page_size,
        dtype=kvc.kv_cache_dtype,
        config=kvc.model_config.hf_config,
        device=kvc.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        swa_size=sizes.swa_max_total_num_tokens if kvc.is_hybrid_swa else None,
    )
