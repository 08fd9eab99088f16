"""The seams of the `ernie55` backend: what a layer hands it beside q, k, v (`HCAInputs` / `MLAInputs`, as the
one keyword `ernie_inputs` of `RadixAttention.forward`), the decode / verify rows the SGLang adapter hands its
implementations (`TokenRows`), and the surface every implementation offers the adapter (`AttnImpl`). The layer
kind is the config's (`layer_types[layer_id]`); the inputs' type must match it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import torch
from sglang.srt.model_executor.forward_context import get_attn_backend, has_forward_context

from ..configuration import LAYER_HCA, LAYER_MLA_DSA

INPUTS_KW = "ernie_inputs"  # the one keyword RadixAttention.forward passes through to the backend


# eq=False: the fields are tensors and modules, compared (and hashed) by identity
@dataclasses.dataclass(frozen=True, eq=False)
class HCAInputs:
    """An HCA layer's inputs beside q [T, h, D] and kv [T, D] (k = v).

    cs:         [T, 2D], the compressor's [values | scores] of every token, in the layer's dtype (rows may be
                strided: a column slice of the layer's merged input projection); both paths read it as fp32;
    compressor: the layer's `Compressor` (`compress(rows, block_idx)`, `ape`, `norm`, `eps`, `inv_freq`);
    sink:       [h] fp32, the per-head attention sink logits."""

    kind: ClassVar[str] = LAYER_HCA
    cs: torch.Tensor
    compressor: torch.nn.Module
    sink: torch.Tensor

    def first_rows(self, n: int) -> HCAInputs:
        """These inputs for the first n token rows (see `real_rows`)."""
        return dataclasses.replace(self, cs=self.cs[:n])


@dataclasses.dataclass(frozen=True, eq=False)
class MLAInputs:
    """An MLA-DSA layer's lightning-indexer inputs beside the absorbed q [T, h, r + dr] and the cache row
    k = [latent | k_pe] [T, r + dr].

    index_q: [T, nI, dI] indexer queries; index_w: [T, nI] their head weights; index_k: [T, dI] the indexer
    key of every token (stored in the pool)."""

    kind: ClassVar[str] = LAYER_MLA_DSA
    index_q: torch.Tensor
    index_w: torch.Tensor
    index_k: torch.Tensor

    def first_rows(self, n: int) -> MLAInputs:
        """These inputs for the first n token rows (see `real_rows`)."""
        return dataclasses.replace(
            self, index_q=self.index_q[:n], index_w=self.index_w[:n], index_k=self.index_k[:n]
        )


LayerInputs = HCAInputs | MLAInputs


def query_dtype(kind: str) -> torch.dtype | None:
    """The dtype this forward's attention backend (SGLang's forward context, where RadixAttention finds it)
    rounds a `kind` layer's queries to before its kernels (the backend's `ernie_query_dtype`), so the layer
    can emit them in it once instead of fp32 plus a copy; None (fp32 queries) where the backend keeps them
    fp32, is not ours (the ECHO draft's), or no forward is running."""
    if not has_forward_context():
        return None
    fn = getattr(get_attn_backend(), "ernie_query_dtype", None)
    return fn(kind) if fn is not None else None


def real_rows(inputs: LayerInputs, q: torch.Tensor) -> LayerInputs:
    """`inputs` narrowed to the query rows the backend was handed. Under attention DP at attention TP > 1 SGLang
    pads a rank's EXTEND batch to a multiple of the attention TP size and hands the backend only the real rows
    (`radix_attention._attention_on_real_rows` narrows q, k, v, out_cache_loc, positions and the keyword inputs it
    knows, then pads the output back with zeros); the per-row tensors inside `ernie_inputs` arrive padded."""
    rows = inputs.cs if isinstance(inputs, HCAInputs) else inputs.index_k
    return inputs.first_rows(q.shape[0]) if rows.shape[0] > q.shape[0] else inputs


@dataclasses.dataclass(frozen=True, eq=False)
class TokenRows:
    """A fixed-shape batch of `per_req` new tokens per request (DECODE: 1; TARGET_VERIFY: S+1), request-major.

    req [B] request slots, seq_lens [B] SGLang's lengths, loc [B * per_req] the KV slots; `width` bounds every
    sequence length (the context length under CUDA graphs). `counted`: whether seq_lens already count the new
    tokens (DECODE does, TARGET_VERIFY does not)."""

    req: torch.Tensor
    seq_lens: torch.Tensor
    loc: torch.Tensor
    per_req: int
    width: int
    counted: bool

    @property
    def seq_after(self) -> torch.Tensor:
        """[B] sequence lengths after the batch's tokens (a device op when not counted: call it where it may
        be recorded, i.e. inside the metadata build)."""
        return self.seq_lens if self.counted else self.seq_lens + self.per_req


class AttnImpl(Protocol):
    """One compute of the backend (torch_path.TorchPath, kernel_path.KernelPath) for the layer kinds given to it.
    It owns its per-forward metadata: built once per forward by the init_* calls, read by every layer."""

    def init_extend(self, fb, split=None) -> None:
        """Eager EXTEND (prefill, chunked prefill, prefix hits, mixed batches): ragged rows from fb's host lists.
        `split` (attention.cp.Split): under SGLang's prefill CP, the batch rows of this rank's queries; the keys
        handed to `extend` are then every rank's, in batch order."""

    def init_rows(self, rows: TokenRows) -> None:
        """Eager DECODE / TARGET_VERIFY."""

    def init_graph_host(self, per_req: int, width: int) -> None:
        """CUDA graphs, outside the graph (capture and every replay): host state only."""

    def init_graph_device(self, rows: TokenRows) -> None:
        """CUDA graphs, inside the graph: device ops on the runner's static buffers only."""

    def extend(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        """One layer of an EXTEND batch: store its KV, attend. kv [T, width] (k = the cache row)."""

    def rows(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        """One layer of a DECODE / TARGET_VERIFY batch (fixed shapes, graph-safe)."""
