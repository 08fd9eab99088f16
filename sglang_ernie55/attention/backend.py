"""The `ernie55` attention backend over `Ernie55TokenToKVPool` (docs/serving-design.md).

The math is the reference's (sglang_ernie55.reference): HCA = raw window + compressed blocks + per-head
sink (K = V); MLA-DSA = absorbed MLA over the top-`index_topk` keys of the lightning indexer (ties to
the earlier position). Two computes serve it, chosen per layer kind by `SGLANG_ERNIE55_ATTN_IMPL`
(sglang_ernie55.attention.select; logged once per kind). Decode and speculative verify (TARGET_VERIFY: S+1
rows per request at positions L..L+S, L = seq_lens, causal among them, KV written at out_cache_loc) are
fixed-shape programs over the batch's token rows in both computes, so SGLang's decode CUDA-graph runner
captures both (it captures TARGET_VERIFY with S+1 tokens per request when the server speculates):

- the kernels (`kernel_path.py`; default on CUDA): Triton stores, block compression, indexer and sparse
  attention, FlashMLA's sparse decode for the attention where its geometry fits; one `KernelMeta` of index
  rows per forward, built on the device, read by every layer;
- torch (`torch_path.py`; the CPU path, the oracle, and the fallback for geometries no kernel takes): keys
  in bounded chunks with an online softmax, so memory never grows with context length x batch.

Both are graph-safe in decode (static shapes; padded rows write only padding / scratch rows), so
SGLang's decode CUDA graphs capture them. Per-layer inputs come from the model through
`RadixAttention(**kwargs)` (see sglang_ernie55.layers.attention).

Window addressing: every HCA window row is read and written at `pool.window_loc(full_loc)` (the SWA slot
of SGLang's hybrid allocator, identity without an SWA pool); compressed entries, MLA latents, indexer keys
and the open-block state keep full-pool / request addressing (the kernel path likewise, through
`kernel_path.window_slots`).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..configuration import LAYER_HCA, LAYER_MLA_DSA
from ..mem_cache.pool import Ernie55TokenToKVPool
from . import kernel_path as kp
from . import select
from .torch_path import DecodeMeta, ExtendMeta, TorchHCA, TorchMLA

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
    def __init__(self, model_runner, impl: str | None = None, deterministic: bool | None = None) -> None:
        """impl: overrides SGLANG_ERNIE55_ATTN_IMPL; deterministic: overrides the server's
        --enable-deterministic-inference (both for in-process tests)."""
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, Ernie55TokenToKVPool):
            raise TypeError(
                f"the ernie55 attention backend serves ERNIE-5.5 only; its KV pool is {type(pool).__name__}, "
                "expected Ernie55TokenToKVPool (is sglang_ernie55.mem_cache.register() active?)"
            )
        cfg = model_runner.model_config.hf_config
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_ctx = self.req_to_token.shape[1]
        self.page_size = pool.page_size
        self.max_context_len = self.max_ctx  # read by SGLang's EAGLE verify-input builder
        self.W, self.ratio, self.topk = cfg.window_size, cfg.compress_ratio, cfg.index_topk
        self.meta: ExtendMeta | DecodeMeta | None = None  # the twin's metadata
        self.kmeta: kp.KernelMeta | None = None  # the kernels' metadata
        from sglang.srt.runtime_context import get_parallel

        from ..envs import attn_impl

        tp = get_parallel().attn_tp_size  # the layers' heads shard over attention TP
        heads = {LAYER_HCA: cfg.num_attention_heads // tp, LAYER_MLA_DSA: cfg.num_attention_heads // tp}
        self.deterministic = deterministic_inference() if deterministic is None else deterministic
        self.choice = select.resolve(impl or attn_impl(), cfg, pool, heads, self.deterministic)
        # batch-invariant attention splits (kernel path) under --enable-deterministic-inference
        self.split_keys = kp.DETERMINISTIC_SPLIT_KEYS if self.deterministic else None
        # MMA operands of the kernels: bf16 (production); fp32 with fp32 activations (`--dtype float32`, the
        # exactness runs), whose dots then run in IEEE fp32 like the twin's
        fp32 = getattr(model_runner.model_config, "dtype", None) == torch.float32
        self.query_dtype = torch.float32 if fp32 else torch.bfloat16
        self.twin = any(not c.kernels for c in self.choice.values())
        self.kernels = any(c.kernels for c in self.choice.values())
        # page starts of every request slot (a view): page_table = page_starts[req] // page_size
        self.page_starts = self.req_to_token[:, :: self.page_size]
        self.graph_width = self.max_ctx
        self._rope_tables: dict = {}
        from ..mem_cache.sizing import SIZING_LOG, device_memory

        if device_memory(pool.device):
            logger.info(f"{SIZING_LOG} at attention-backend set-up: {device_memory(pool.device)}")
        self.torch_hca = TorchHCA(pool, self.req_to_token, self.W, self.ratio)
        self.torch_mla = TorchMLA(pool, self.req_to_token, self.topk)

    def impl(self, kind: str) -> str:
        return self.choice[kind].impl

    def rope_tables(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin fp32 [max_ctx, rope / 2] of the model's RoPE table (the compression kernel's), built once."""
        key = (inv_freq.device, inv_freq.data_ptr())
        if key not in self._rope_tables:
            from ..reference.rope import cos_sin

            pos = torch.arange(self.max_ctx, device=inv_freq.device)
            self._rope_tables[key] = tuple(t.contiguous() for t in cos_sin(pos, inv_freq.float()))
        return self._rope_tables[key]

    # ------------------------------------------------------------------ metadata
    def _round_width(self, n: int) -> int:
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

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager: the metadata of every compute in use, once per forward."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            k = self._verify_rows(forward_batch)
            lens = forward_batch.seq_lens_cpu
            width = self._round_width(int(lens.max()) + k if lens is not None and len(lens) else self.max_ctx)
            self.meta = DecodeMeta(width, k)
            if self.kernels:
                self.kmeta = self._verify_kmeta(forward_batch, k, width)
        elif mode.is_decode_or_idle():
            lens = forward_batch.seq_lens_cpu
            width = self._round_width(int(lens.max()) if lens is not None and len(lens) else self.max_ctx)
            if self.twin:
                self.meta = DecodeMeta(width)
            if self.kernels:
                self.kmeta = kp.decode_meta(self, forward_batch, width)
        elif mode.is_extend():
            if self.twin:
                self.meta = ExtendMeta(
                    req=forward_batch.req_pool_indices.tolist(),
                    prefix=list(forward_batch.extend_prefix_lens_cpu),
                    extend=list(forward_batch.extend_seq_lens_cpu),
                )
            if self.kernels:
                self.kmeta = kp.extend_meta(self, forward_batch)
        else:
            raise NotImplementedError(
                f"ernie55 backend: forward mode {mode} is not a target-model mode (the ECHO draft's own "
                "backend, sglang_ernie55.attention.draft_backend, serves the draft's DRAFT_EXTEND_V2 and decode)"
            )

    # CUDA graphs (decode, and TARGET_VERIFY when speculating): every op reads the runner's static buffers
    # (padded rows: req slot 0, out_cache_loc 0 = the padding page, seq_len 1); widths are the full
    # context, so the captured program depends on nothing but the batch size.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_width = self.max_ctx

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host part (capture and every replay): nothing on the device; the twin's static width and the rows
        per request (1, or S+1 in TARGET_VERIFY)."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            self.meta = DecodeMeta(self.graph_width, self._verify_rows(forward_batch))
        elif mode.is_decode_or_idle():
            self.meta = DecodeMeta(self.graph_width)
        else:
            raise NotImplementedError(f"ernie55 backend: CUDA graphs cover decode and target verify, not {mode}")

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the graph: the kernels' index rows from the runner's static buffers (device ops
        only), and fresh FlashMLA schedules that the captured first layer of each kind fills."""
        if not self.kernels:
            return
        if forward_batch.forward_mode.is_target_verify():
            self.kmeta = self._verify_kmeta(forward_batch, self.meta.per_req, self.graph_width)
        else:
            self.kmeta = kp.decode_meta(self, forward_batch, self.graph_width)

    def _verify_kmeta(self, fb, k: int, width: int):
        """The kernels' rows of a TARGET_VERIFY batch: k = S+1 new tokens per request at seq_lens .. seq_lens
        + k - 1 (SGLang's seq_lens exclude them); device ops only (graph-safe)."""
        return kp.fixed_meta(self, fb.req_pool_indices, fb.seq_lens + k, fb.out_cache_loc, k, width)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs) -> None:
        """Nothing to refill: verify metadata depends only on seq_lens, req_pool_indices and out_cache_loc,
        not on the draft tokens, positions or a tree mask (chains only: causal rows, no custom mask)."""

    def _token_rows(self, fb, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request slot, position) of each of the T query rows: DECODE has one row per request at
        seq_len - 1; TARGET_VERIFY has T / bs rows per request at seq_len .. seq_len + T / bs - 1 (SGLang's
        seq_lens exclude the verified tokens). Static shapes, no host sync (CUDA-graph safe)."""
        req, L = fb.req_pool_indices, fb.seq_lens
        if not fb.forward_mode.is_target_verify():
            return req, L - 1
        bs = req.shape[0]
        k = T // max(bs, 1)
        if k * bs != T or k != self.meta.per_req:
            raise ValueError(f"ernie55 backend: TARGET_VERIFY with {T} rows for {bs} requests, expected "
                             f"{self.meta.per_req} rows each")  # fmt: skip
        off = torch.arange(k, device=L.device, dtype=L.dtype)
        return req.repeat_interleave(k), (L[:, None] + off[None, :]).reshape(-1)

    # ------------------------------------------------------------------ entry points
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        if forward_batch.forward_mode.is_target_verify():  # SGLang routes verify here; it is a row program
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kw)
        if self.kernels and self._kernel_kind(kw) is not None:
            return self._kernel_forward(q, k, layer, kw)
        kv = k.view(-1, k.shape[-1])
        loc = forward_batch.out_cache_loc
        if kw.get("ernie_kind") == "hca":
            return self.torch_hca.extend(q, kv, kw["cs"], kw["compressor"], kw["attn_sink"], layer.scaling,
                                         layer.layer_id, loc, self.meta)
        return self.torch_mla.extend(q, kv, kw["index_q"], kw["index_w"], kw["index_k"], layer.scaling,
                                     layer.v_head_dim, layer.layer_id, loc, self.meta)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        if self.kernels and self._kernel_kind(kw) is not None:
            return self._kernel_forward(q, k, layer, kw)
        kv = k.view(-1, k.shape[-1])
        loc = forward_batch.out_cache_loc
        req, pos = self._token_rows(forward_batch, q.shape[0])
        if kw.get("ernie_kind") == "hca":
            return self.torch_hca.decode(q, kv, kw["cs"], kw["compressor"], kw["attn_sink"], layer.scaling,
                                         layer.layer_id, loc, req, pos, self.meta.width)
        return self.torch_mla.decode(q, kv, kw["index_q"], kw["index_w"], kw["index_k"], layer.scaling,
                                     layer.v_head_dim, layer.layer_id, loc, req, pos, self.meta.width)

    def _kernel_kind(self, kw) -> str | None:
        kind = LAYER_HCA if kw.get("ernie_kind") == "hca" else LAYER_MLA_DSA
        return kind if self.choice[kind].kernels else None

    def _kernel_forward(self, q, k, layer, kw):
        m = self.kmeta
        if m is None or m.num_tokens != q.shape[0]:
            raise RuntimeError(
                f"ernie55 backend: kernel metadata for {None if m is None else m.num_tokens} tokens, the layer "
                f"has {q.shape[0]} (init_forward_metadata must run for every forward)"
            )
        kv = k.view(-1, k.shape[-1])
        if kw.get("ernie_kind") == "hca":
            return kp.hca_forward(self, m, self.impl(LAYER_HCA), q, kv, kw["cs"], kw["compressor"],
                                  kw["attn_sink"], layer)  # fmt: skip
        return kp.mla_forward(self, m, self.impl(LAYER_MLA_DSA), q, kv, kw["index_q"], kw["index_w"],
                              kw["index_k"], layer)  # fmt: skip
