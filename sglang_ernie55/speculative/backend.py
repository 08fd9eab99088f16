"""Attention backends of the ECHO draft: window-only attention over `EchoDraftKVPool` (torch, stage 1).

Every draft query at position p reads the draft's own rows at positions max(0, p-W+1) .. p of its
request (`pool.window_loc(req_to_token[req, pos])`, the SWA slot in hybrid mode: SGLang's EAGLE v2 has
already placed every position of the iteration's verify window in `req_to_token`, so draft-extend,
chained draft decode and the rows they write are all addressed the same way). An HCA last layer adds the per-head sink (its K = V rows carry
no compressed entries); an MLA-DSA last layer runs plain absorbed MLA over the window (no indexer).

Each row gathers exactly W keys: one fixed-shape program per token count, so SGLang's draft-decode
CUDA graph (EAGLEDraftCudaGraphRunner) records it with no metadata of its own; padded graph rows read
request slot 0 and write the padding page.

- `EchoDraftAttnBackend`: draft-extend (prefill EXTEND, DRAFT_EXTEND_V2) and one decode step;
- `EchoMultiStepDraftBackend`: the per-step container SGLang's EAGLE worker drives (`attn_backends[i]`
  for chained step i, steps - 1 of them).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..attention import BACKEND_NAME
from ..attention.backend import _masked_sink_attention
from ..configuration import LAYER_HCA
from .pool import EchoDraftKVPool


class EchoDraftAttnBackend(AttentionBackend):
    needs_cpu_seq_lens = False

    def __init__(self, model_runner) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, EchoDraftKVPool):
            raise TypeError(
                f"the ECHO draft backend needs EchoDraftKVPool, the draft runner's pool is {type(pool).__name__} "
                "(is sglang_ernie55.speculative.register() active?)"
            )
        cfg = model_runner.model_config.hf_config
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.W = cfg.window_size
        self.kind = cfg.layer_types[-1]
        self._row_reqs: torch.Tensor | None = None  # EXTEND: request slot of each token row (eager)
        self.prefill_attention_backend_str = self.decode_attention_backend_str = BACKEND_NAME

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch) -> None:
        self.init_forward_metadata_out_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        fb = forward_batch
        self._row_reqs = None
        if fb.forward_mode.is_extend() and not fb.forward_mode.is_target_verify():
            lens = getattr(fb, "extend_seq_lens_cpu", None)
            if lens is not None:  # prefill draft-extend: ragged rows per request
                reps = torch.as_tensor(list(lens), device=fb.req_pool_indices.device)
                self._row_reqs = torch.repeat_interleave(
                    fb.req_pool_indices, reps, output_size=int(sum(lens))
                )

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        pass

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass  # nothing beyond the runner's static buffers

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _rows(self, T: int, fb) -> torch.Tensor:
        """Request slot of each of the T query rows."""
        if self._row_reqs is not None and self._row_reqs.shape[0] == T:
            return self._row_reqs
        req = fb.req_pool_indices
        if T % req.shape[0]:
            raise ValueError(f"ECHO draft: {T} rows for {req.shape[0]} requests and no extend lengths")
        return req.repeat_interleave(T // req.shape[0])  # decode (1 per request), DRAFT_EXTEND_V2 (k each)

    # ------------------------------------------------------------------ attention
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        return self._window_attention(q, k, layer, forward_batch, kw)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kw):
        return self._window_attention(q, k, layer, forward_batch, kw)

    def _window_attention(self, q, k, layer, fb, kw):
        rows = self.pool.check_layer(layer.layer_id)
        k = k.reshape(k.shape[0], -1)
        rows.write(self.pool.window_loc(fb.out_cache_loc), k)
        T, W = q.shape[0], self.W
        req, pos = self._rows(T, fb), fb.positions
        wpos = pos[:, None] - (W - 1) + torch.arange(W, device=q.device)
        mask = wpos >= 0
        keys = rows.read(self.pool.window_loc(self.req_to_token[req[:, None].long(), wpos.clamp(min=0)]))
        if self.kind == LAYER_HCA:
            return _masked_sink_attention(q, keys, keys, mask, kw["attn_sink"], layer.scaling)
        r = layer.v_head_dim
        return _masked_sink_attention(q, keys, keys[..., :r], mask, None, layer.scaling)


class EchoMultiStepDraftBackend:
    """One EchoDraftAttnBackend per chained draft step (SGLang calls `attn_backends[i]` for step i)."""

    needs_cpu_seq_lens = False

    def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
        if topk != 1:
            raise ValueError(f"ECHO drafts chains only (--speculative-eagle-topk 1), got topk {topk}")
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.attn_backends = [EchoDraftAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)]
        self.prefill_attention_backend_str = self.decode_attention_backend_str = BACKEND_NAME

    def init_forward_metadata(self, forward_batch) -> None:
        for b in self.attn_backends:
            b.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        for b in self.attn_backends:
            b.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        for b in self.attn_backends:
            b.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for b in self.attn_backends:
            b.init_cuda_graph_state(max_bs, max_num_tokens)
