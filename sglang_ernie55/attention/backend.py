"""The `ernie55` attention backend: a thin adapter from SGLang's `AttentionBackend` surface to the implementations
that compute ERNIE-5.5's attention (HCA, MLA-DSA; docs/serving-design.md sections 2, 6). It owns what is SGLang's
(forward-mode dispatch, the rows of verify batches, the CUDA-graph width) and delegates each layer, by the kind
the config gives its layer id, to the implementation `select` chose for that kind (`TorchPath`, `KernelPath`),
which owns its per-forward metadata.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..configuration import LAYER_HCA, LAYER_MLA_DSA
from ..mem_cache.pool import Ernie55TokenToKVPool
from . import select
from .cp import Split, gather_keys, split_of
from .interface import AttnImpl, LayerInputs, TokenRows, real_rows

logger = logging.getLogger(__name__)


def deterministic_inference() -> bool:
    """SGLang's `--enable-deterministic-inference` of the running server (False outside a server, where SGLang's
    runtime context is not published, e.g. in-process tests)."""
    from sglang.srt.runtime_context import get_exec

    try:
        return bool(get_exec().deterministic.enable_deterministic_inference)
    except ValueError:  # "... not published": no server configuration in this process
        return False


class Ernie55AttnBackend(AttentionBackend):
    """Decode and speculative verify (TARGET_VERIFY: S+1 rows per request at positions L..L+S, L = seq_lens,
    causal among them, KV written at out_cache_loc) are fixed-shape row programs in every implementation, so
    SGLang's decode CUDA-graph runner captures both (TARGET_VERIFY with S+1 tokens per request when the server
    speculates); extend runs eager. Every HCA window row is read and written at `pool.window_loc(full_loc)` (the
    SWA slot of SGLang's hybrid allocator); compressed entries, MLA latents, indexer keys and the open-block
    state keep full-pool / request addressing."""

    def __init__(self, model_runner, impl: str | None = None, deterministic: bool | None = None) -> None:
        """impl: overrides SGLANG_ERNIE55_ATTN_IMPL; deterministic: overrides the server's
        --enable-deterministic-inference (both for in-process tests)."""
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, Ernie55TokenToKVPool):
            raise TypeError(
                f"the ernie55 attention backend serves ERNIE-5.5 only; its KV pool is {type(pool).__name__}, "
                "expected Ernie55TokenToKVPool (is the sglang_ernie55 plugin loaded? its patches.register() installs the pool hook)"
            )
        from sglang.srt.runtime_context import get_parallel

        from ..envs import attn_impl
        from ..mem_cache.sizing import SIZING_LOG, device_memory
        from .kernel_path import DETERMINISTIC_SPLIT_KEYS

        cfg = model_runner.model_config.hf_config
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_ctx = self.req_to_token.shape[1]
        self.max_context_len = self.max_ctx  # read by SGLang's EAGLE verify-input builder
        self.ratio = cfg.compress_ratio  # eager widths are whole compression blocks
        self.layer_kinds = list(cfg.layer_types)  # the kind of every layer id
        tp = get_parallel().attn_tp_size  # the layers' heads shard over attention TP
        heads = {LAYER_HCA: cfg.num_attention_heads // tp, LAYER_MLA_DSA: cfg.num_attention_heads // tp}
        self.deterministic = deterministic_inference() if deterministic is None else deterministic
        self.choice = select.resolve(impl or attn_impl(), cfg, pool, heads, self.deterministic)
        # batch-invariant attention splits (kernels) under --enable-deterministic-inference
        split_keys = DETERMINISTIC_SPLIT_KEYS if self.deterministic else None
        # MMA operands of the kernels: bf16 (production); fp32 with fp32 activations (`--dtype float32`, the
        # exactness runs), whose dots then run in IEEE fp32 like the torch path's
        fp32 = getattr(model_runner.model_config, "dtype", None) == torch.float32
        query_dtype = torch.float32 if fp32 else torch.bfloat16
        self.impls: dict[str, AttnImpl] = select.build(
            self.choice, pool, self.req_to_token, cfg, split_keys, query_dtype
        )
        self._distinct = list({id(i): i for i in self.impls.values()}.values())  # each metadata built once
        self.graph_width = self.max_ctx
        self._graph_per_req = 1  # rows per request of the graph batch (set outside the graph)
        self._split: Split | None = None  # this forward's prefill-CP split (EXTEND only)
        self._split_logged = False
        if device_memory(pool.device):
            logger.info(f"{SIZING_LOG} at attention-backend set-up: {device_memory(pool.device)}")

    # ------------------------------------------------------------------ metadata
    def _eager_width(self, fb, extra: int) -> int:
        """Key positions a row of this batch may see: the longest sequence (+ `extra` verify rows), in whole
        compression blocks, at most the context length."""
        lens = fb.seq_lens_cpu
        n = int(lens.max()) + extra if lens is not None and len(lens) else self.max_ctx
        return min(self.max_ctx, -(-max(n, 1) // self.ratio) * self.ratio)

    def _verify_rows(self, forward_batch) -> int:
        """S+1: the rows per request of a TARGET_VERIFY batch (SGLang's EagleVerifyInput.draft_token_num)."""
        if self.pool.state_ring < 2 * self.ratio:
            raise RuntimeError(
                "ernie55 backend: TARGET_VERIFY needs the two-block open-block compression state (rejected drafts "
                f"past a block boundary), but the pool keeps {self.pool.state_ring} rows per request; the pool "
                "hook builds it with state_blocks=2 whenever --speculative-algorithm is set"
            )
        k = getattr(forward_batch.spec_info, "draft_token_num", None)
        if not k:
            raise ValueError("ernie55 backend: a TARGET_VERIFY batch without spec_info.draft_token_num")
        return int(k)

    @staticmethod
    def _token_rows(fb, per_req: int, width: int) -> TokenRows:
        """The batch's rows in the implementations' terms (SGLang's TARGET_VERIFY seq_lens exclude its rows)."""
        counted = not fb.forward_mode.is_target_verify()
        return TokenRows(fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, per_req, width, counted)

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager: every implementation in use builds its metadata, once per forward."""
        fb, mode = forward_batch, forward_batch.forward_mode
        self._split = None
        if mode.is_target_verify():
            k = self._verify_rows(fb)
            rows = self._token_rows(fb, k, self._eager_width(fb, k))
        elif mode.is_decode_or_idle():
            rows = self._token_rows(fb, 1, self._eager_width(fb, 0))
        elif mode.is_extend():
            # under SGLang's prefill CP (attention.cp): this rank's query rows; keys are gathered per layer
            self._split = split_of(fb)
            if self._split is not None and not self._split_logged:
                self._split_logged = True
                logger.info(
                    f"ernie55 backend: prefill CP splits this extend: {len(self._split.qidx)} of "
                    f"{sum(fb.extend_seq_lens_cpu)} query rows on this rank, every rank's keys gathered per layer"
                )
            for impl in self._distinct:
                impl.init_extend(fb, self._split)
            return
        else:
            raise NotImplementedError(
                f"ernie55 backend: forward mode {mode} is not a target-model mode (the ECHO draft's own "
                "backend, sglang_ernie55.attention.draft_backend, serves the draft's DRAFT_EXTEND_V2 and decode)"
            )
        for impl in self._distinct:
            impl.init_rows(rows)

    # CUDA graphs (decode, and TARGET_VERIFY when speculating): every op reads the runner's static buffers
    # (padded rows: req slot 0, out_cache_loc 0 = the padding page, seq_len 1); widths are the full
    # context, so the captured program depends on nothing but the batch size.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_width = self.max_ctx

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host part (capture and every replay): the rows per request (1, or S+1 in TARGET_VERIFY) and each
        implementation's host state; nothing on the device."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            self._graph_per_req = self._verify_rows(forward_batch)
        elif mode.is_decode_or_idle():
            self._graph_per_req = 1
        else:
            raise NotImplementedError(
                f"ernie55 backend: CUDA graphs cover decode and target verify, not {mode}"
            )
        for impl in self._distinct:
            impl.init_graph_host(self._graph_per_req, self.graph_width)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph: each implementation's device metadata from the runner's static buffers."""
        fb = forward_batch
        per_req = self._graph_per_req if fb.forward_mode.is_target_verify() else 1
        rows = self._token_rows(fb, per_req, self.graph_width)
        for impl in self._distinct:
            impl.init_graph_device(rows)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to refill: verify metadata depends only on seq_lens, req_pool_indices and out_cache_loc,
        not on the draft tokens, positions or a tree mask (chains only: causal rows, no custom mask)."""

    # ------------------------------------------------------------------ layers
    def ernie_query_dtype(self, kind: str) -> torch.dtype | None:
        """What this batch's implementation of `kind` layers rounds their queries to first (the kernel path's
        `query_dtype`); None where they stay fp32 (the torch path, a CP-split extend, which runs it)."""
        if self._split is not None:
            return None
        return getattr(self.impls.get(kind), "query_dtype", None)

    def _route(self, layer, inputs: LayerInputs) -> tuple[str, AttnImpl]:
        self.pool.wait_layer_transfer(layer.layer_id)  # a HiCache load of this layer's pages has landed
        kind = self.layer_kinds[layer.layer_id]
        if inputs.kind != kind:
            raise TypeError(
                f"ernie55 backend: layer {layer.layer_id} is a {kind} layer (config.layer_types), its inputs are "
                f"{type(inputs).__name__}"
            )
        return kind, self.impls[kind]

    def forward_extend(
        self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, *, ernie_inputs: LayerInputs
    ):
        if forward_batch.forward_mode.is_target_verify():  # SGLang routes verify here; it is a row program
            return self.forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache, ernie_inputs=ernie_inputs
            )
        kind, impl = self._route(layer, ernie_inputs)
        ernie_inputs = real_rows(ernie_inputs, q)  # a batch SGLang padded for attention TP > 1 under DP
        if self._split is not None:  # a CP-split extend: every rank's keys, this rank's queries
            k, ernie_inputs = gather_keys(self._split, forward_batch, k, ernie_inputs)
        return impl.extend(kind, q, k.view(-1, k.shape[-1]), ernie_inputs, layer, forward_batch)

    def forward_decode(
        self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, *, ernie_inputs: LayerInputs
    ):
        kind, impl = self._route(layer, ernie_inputs)
        return impl.rows(kind, q, k.view(-1, k.shape[-1]), ernie_inputs, layer, forward_batch)
