"""The ledger's PD hooks for the ERNIE-5.5 pools (docs/hooks.md, "PD disaggregation"): SGLang's PD code picks the
buffer handling by pool class; these answer its isinstance gates for ours. What the pools transfer:
`mem_cache/pd_layout.py`.
"""

from __future__ import annotations

from .draft_pool import EchoDraftKVPool
from .pd_layout import state_buf_infos
from .pool import Ernie55TokenToKVPool

PD_LOG = "ERNIE-5.5 PD:"


def is_ernie55_pool(pool) -> bool:
    return isinstance(pool, Ernie55TokenToKVPool)


def around_is_mla_backend(original, target_kv_pool, *args, **kwargs):
    """AROUND `disaggregation.utils.is_mla_backend`: our pool transfers as SGLang's MLA pools do, one region per
    buffer (no K / V halves) replicated over attention-TP ranks (every row is per token, not per head)."""
    if is_ernie55_pool(target_kv_pool):
        return True
    return original(target_kv_pool, *args, **kwargs)


def around_uses_swa_tail_prealloc(original, self, *args, **kwargs):
    """AROUND `DecodePreallocQueue._uses_swa_tail_prealloc`: a decode server allocates SWA slots for the window
    tail of a prompt only (the pages the prefill server sends as `StateType.SWA`), as for SGLang's own SWA pools.
    Without it SGLang charges the whole prompt to the SWA pool plus the decode reserve, and a prompt longer than
    the SWA pool less that reserve waits in the queue for ever."""
    pool = self.token_to_kv_pool
    if is_ernie55_pool(pool) and pool.is_hybrid_swa:
        allocator = self.token_to_kv_pool_allocator
        return allocator.page_size > 1 and hasattr(allocator, "alloc_extend_swa_tail")
    return original(self, *args, **kwargs)


_COMPONENT_FIELDS = (
    "state_types",
    "state_data_ptrs",
    "state_data_lens",
    "state_item_lens",
    "state_dim_per_tensor",
    "state_conv_shard_groups",
    "state_slice_outer_counts",
    "state_layer_ids",
)


def _drop_component(kv_args, i: int) -> None:
    """Remove state component `i` from every parallel list `append_state_component` fills."""
    for name in _COMPONENT_FIELDS:
        del getattr(kv_args, name)[i]


def around_setup_state_kv_args(
    original, kv_args, token_to_kv_pool, draft_token_to_kv_pool=None, *args, **kwargs
):
    """AROUND `disaggregation.utils.setup_state_kv_args`: SGLang builds our pool's components through its
    `BaseSWAKVPool` branch (the window rows as `StateType.SWA`, the open-block state as
    `StateType.DSV4_REQUEST_STATE`); the ECHO draft's rows, at the same SWA slots, go as a second `StateType.SWA`
    component, as DeepSeek-V4's NextN draft rows do (SGLang pairs those only for its own pool classes)."""
    if not is_ernie55_pool(token_to_kv_pool):
        return original(kv_args, token_to_kv_pool, draft_token_to_kv_pool, *args, **kwargs)
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    out = original(kv_args, token_to_kv_pool, None, *args, **kwargs)
    if not token_to_kv_pool.is_hybrid_swa:
        # no SWA pool: the window rows are full-slot KV data; SGLang's SWA component would ask a plain allocator
        # for SWA slots
        for i in reversed(range(len(kv_args.state_types))):
            if kv_args.state_types[i] == StateType.SWA and not kv_args.state_data_ptrs[i]:
                _drop_component(kv_args, i)
    if draft_token_to_kv_pool is None:
        return out
    if not isinstance(draft_token_to_kv_pool, EchoDraftKVPool):
        raise NotImplementedError(
            f"{PD_LOG} the draft pool must be the ECHO draft's EchoDraftKVPool, got "
            f"{type(draft_token_to_kv_pool).__name__}"
        )
    if draft_token_to_kv_pool.is_hybrid_swa != token_to_kv_pool.is_hybrid_swa:
        raise RuntimeError(
            f"{PD_LOG} the ECHO draft pool and the target pool must both have an SWA pool or neither"
        )
    if token_to_kv_pool.is_hybrid_swa:
        append_state_component(kv_args, StateType.SWA, *state_buf_infos(draft_token_to_kv_pool))
    return out
