"""SGLang's prefill context parallelism (`--attn-cp-size N --enable-prefill-cp --cp-strategy interleave`) as the
`ernie55` backend and the model meet it (docs/serving-design.md section 8.2): a split EXTEND batch gives each CP
rank some of its rows; a layer gathers every rank's key side (what the pools store and compress) in batch order
and attends only the rank's own queries (`Split.qidx`); the FFNs, sharded over the whole TP group, run on every
rank's rows (`ffn_rows`). DECODE, TARGET_VERIFY and IDLE batches are not split.
"""

from __future__ import annotations

import dataclasses

import torch

from .interface import HCAInputs, LayerInputs, MLAInputs


@dataclasses.dataclass(frozen=True)
class Split:
    """This CP rank's share of a split EXTEND batch.

    qidx: the batch row (token order) of each of this rank's query rows, in the rank's row order;
    rows: the rank's row count, padding rows (after the qidx rows, outputs zero) included."""

    strategy: object
    qidx: list[int]
    rows: int


def is_split(fb) -> bool:
    """Whether SGLang's prefill CP splits this forward (cheap: no metadata read beyond the batch's)."""
    if getattr(fb, "attn_cp_metadata", None) is None:
        return False
    from sglang.srt.layers.cp.utils import is_cp_active

    return is_cp_active(fb)


def split_of(fb) -> Split | None:
    """The split of this forward when SGLang's prefill CP splits it (an EXTEND / MIXED batch of at least N
    tokens under --enable-prefill-cp), else None."""
    if not is_split(fb):
        return None
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.runtime_context import get_parallel

    strategy = get_cp_strategy()
    meta = fb.attn_cp_metadata
    qidx = strategy.local_q_indices(meta.total_seq_lens, fb).tolist()
    rows = int(meta.per_rank_actual_token[get_parallel().attn_cp_rank])
    return Split(strategy, qidx, rows)


def gather_keys(split: Split, fb, k: torch.Tensor, inputs: LayerInputs) -> tuple[torch.Tensor, LayerInputs]:
    """(k, inputs) of this rank's rows -> the same with the key side of every rank's rows, in batch order: the
    cache row k and, for HCA, the compressor rows `cs`, for MLA-DSA the indexer keys `index_k` (one all-gather
    per layer: the key-side tensors travel packed). Queries (q, the indexer's index_q / index_w) stay local."""
    k = k.reshape(k.shape[0], -1)
    if isinstance(inputs, HCAInputs):
        side = inputs.cs
    elif isinstance(inputs, MLAInputs):
        side = inputs.index_k
    else:
        raise TypeError(f"ernie55 backend: no CP key gather for {type(inputs).__name__}")
    width = k.shape[-1]
    dtype = torch.promote_types(k.dtype, side.dtype)
    packed = torch.cat([k.to(dtype), side.to(dtype)], dim=-1).contiguous()
    full = split.strategy.gather_kv_cache(packed, fb)
    k_full = full[:, :width].to(k.dtype)
    side_full = full[:, width:].to(side.dtype)
    if isinstance(inputs, HCAInputs):
        return k_full, dataclasses.replace(inputs, cs=side_full)
    return k_full, dataclasses.replace(inputs, index_k=side_full)


def ffn_rows(x: torch.Tensor, ffn) -> torch.Tensor:
    """ffn(rows of every CP rank) for this rank's rows x [rows, H] under a split: SGLang's rank-major all-gather
    of the equal padded shards (`attn_cp_interleave_gather`, what its DeepSeek models do before a MoE with
    --moe-a2a-backend none), the FFN with its TP all-reduce over the gathered rows (the same on every rank of
    the TP group), then this rank's block of rows back. Padding rows run through the FFN and are dropped."""
    from sglang.srt.layers.cp.interleave import attn_cp_interleave_gather
    from sglang.srt.runtime_context import get_parallel

    n = x.shape[0]
    out = ffn(attn_cp_interleave_gather(x.contiguous()))
    rank = get_parallel().attn_cp_rank
    return out[rank * n : (rank + 1) * n]
