"""Attention backends of the ECHO draft: window-only attention over `EchoDraftKVPool` (docs/echo.md).

`EchoDraftAttnBackend` serves draft-extend (prefill EXTEND, DRAFT_EXTEND_V2) and one decode step;
`EchoMultiStepDraftBackend` is the per-step container SGLang's EAGLE worker drives (`attn_backends[i]`).
Every row gathers exactly W keys, so SGLang's draft CUDA-graph runners record it with no metadata of their own.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..configuration import LAYER_HCA
from ..mem_cache.draft_pool import EchoDraftKVPool
from . import BACKEND_NAME, torch_path
from .interface import LayerInputs
from .torch_path import masked_sink_attention, read_cost

logger = logging.getLogger(__name__)


# A draft query at position p reads the draft's own rows at positions max(0, p-W+1) .. p of its request
# (`pool.window_loc(req_to_token[req, pos])`: SGLang's EAGLE v2 has already placed every position of the
# iteration's verify window in `req_to_token`, so draft-extend, chained draft decode and the rows they write are
# addressed the same way). An HCA last layer adds the per-head sink; an MLA-DSA last layer runs plain absorbed MLA
# over the window (no indexer).
#
# Under CUDA graphs (draft decode: `EAGLEDraftCudaGraphRunner`; draft extend: `EAGLEDraftExtendCudaGraphRunner`,
# S+1 rows per request) each row's request is `req_pool_indices.repeat_interleave(T // bs)` computed in the
# forward from the runner's static buffers, so a replay addresses the replayed batch. Padded rows read request
# slot 0 (SGLang's all-zero `req_to_token` row) and write slot 0, which `window_loc` maps into the draft pool's
# padding page. The ragged prefill draft-extend (eager) takes its row -> request map from `extend_seq_lens_cpu`.
class EchoDraftAttnBackend(AttentionBackend):
    needs_cpu_seq_lens = False

    def __init__(self, model_runner) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, EchoDraftKVPool):
            raise TypeError(
                f"the ECHO draft backend needs EchoDraftKVPool, the draft runner's pool is {type(pool).__name__} "
                "(is the sglang_ernie55 plugin loaded? its patches.register() installs the pool hook)"
            )
        cfg = model_runner.model_config.hf_config
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.W = cfg.window_size
        self.kind = cfg.layer_types[-1]
        self._row_reqs: torch.Tensor | None = None  # EXTEND: request slot of each token row (eager)
        self.graph_replays: dict[str, int] = {}  # forward mode name -> CUDA-graph replays (metadata calls)
        self.prefill_attention_backend_str = self.decode_attention_backend_str = BACKEND_NAME

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch) -> None:
        """Eager forwards (SGLang's eager runners and `prepare_for_draft_extend` call this)."""
        self._set_row_map(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """CUDA-graph capture (`in_capture`) and replay: called outside the graph (docstring above)."""
        self._set_row_map(forward_batch)
        if not in_capture:
            mode = forward_batch.forward_mode
            name = getattr(mode, "name", str(mode))
            self.graph_replays[name] = self.graph_replays.get(name, 0) + 1
            if self.graph_replays[name] == 1 and mode.is_draft_extend_v2():
                logger.info(
                    f"ECHO draft: first draft-extend CUDA-graph replay (bs={forward_batch.batch_size})"
                )

    def _set_row_map(self, fb) -> None:
        self._row_reqs = None
        mode = fb.forward_mode
        if mode.is_extend() and not mode.is_target_verify():
            lens = getattr(fb, "extend_seq_lens_cpu", None)
            if lens is not None:  # prefill draft-extend: ragged rows per request (eager)
                reps = torch.as_tensor(list(lens), device=fb.req_pool_indices.device)
                self._row_reqs = torch.repeat_interleave(
                    fb.req_pool_indices, reps, output_size=int(sum(lens))
                )

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        pass  # the forward gathers from the static buffers itself

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass  # nothing beyond the runner's static buffers

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded requests' seq_lens (never read: rows are addressed by position)

    def _rows(self, T: int, fb) -> torch.Tensor:
        """Request slot of each of the T query rows (a device op on `fb.req_pool_indices`, graph-safe for the
        uniform modes)."""
        if self._row_reqs is not None and self._row_reqs.shape[0] == T:
            return self._row_reqs
        req = fb.req_pool_indices
        bs = req.shape[0]
        if T % bs:
            raise ValueError(f"ECHO draft: {T} rows for {bs} requests and no extend lengths")
        k = T // bs  # decode: 1 per request; DRAFT_EXTEND_V2: num_tokens_per_req (S+1) each, request-major
        want = getattr(getattr(fb, "spec_info", None), "num_tokens_per_req", 0) or 0
        if fb.forward_mode.is_draft_extend_v2() and want > 0 and want != k:
            raise ValueError(
                f"ECHO draft: DRAFT_EXTEND_V2 of {T} rows for {bs} requests, expected {want} each"
            )
        return req.repeat_interleave(k)

    # ------------------------------------------------------------------ attention
    def forward_extend(
        self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, *, ernie_inputs: LayerInputs
    ):
        return self._window_attention(q, k, layer, forward_batch, ernie_inputs)

    def forward_decode(
        self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, *, ernie_inputs: LayerInputs
    ):
        return self._window_attention(q, k, layer, forward_batch, ernie_inputs)

    def _window_attention(self, q, k, layer, fb, inputs: LayerInputs):
        rows = self.pool.check_layer(layer.layer_id)
        k = k.reshape(k.shape[0], -1)
        rows.write(self.pool.window_loc(fb.out_cache_loc), k)
        T = q.shape[0]
        req, pos = self._rows(T, fb), fb.positions
        dv = k.shape[-1] if self.kind == LAYER_HCA else layer.v_head_dim
        step = window_row_chunk(self.W, q.shape[1], k.shape[-1], dv, read_cost(rows))
        if T <= step:
            return self._window_rows(q, req, pos, rows, layer, inputs)
        # a prefill draft-extend has up to --chunked-prefill-size rows: whole, its gathered windows and
        # softmax terms take several GB, more than SGLang's default memory fraction leaves beside the pool, so
        # rows go in slices of a fixed transient size
        out = torch.empty(T, q.shape[1], dv, dtype=torch.float32, device=q.device)
        for s in range(0, T, step):
            e = min(T, s + step)
            out[s:e] = self._window_rows(q[s:e], req[s:e], pos[s:e], rows, layer, inputs)
        return out

    def _window_rows(self, q, req, pos, rows, layer, inputs: LayerInputs):
        """Window attention of query rows q [R, h, c] of requests `req` at positions `pos` -> [R, h, dv] fp32."""
        W = self.W
        wpos = pos[:, None] - (W - 1) + torch.arange(W, device=q.device)
        mask = wpos >= 0
        keys = rows.read(self.pool.window_loc(self.req_to_token[req[:, None].long(), wpos.clamp(min=0)]))
        if self.kind == LAYER_HCA:
            return masked_sink_attention(q, keys, keys, mask, inputs.sink, layer.scaling)
        r = layer.v_head_dim
        return masked_sink_attention(q, keys, keys[..., :r], mask, None, layer.scaling)


def window_row_chunk(W: int, heads: int, width: int, dv: int, read_bytes: int) -> int:
    """Query rows per slice of the draft's window attention so that one slice's transient tensors stay within
    `torch_path.CHUNK_BYTES`: per row, W gathered keys (`read_bytes` each while gathered, then the fp32 key
    and its masked copy, the masked value) with their fp32 logits and probabilities per head, and the
    online-softmax terms per head (accumulator, product, rescaled sum)."""
    per_row = W * (read_bytes + 4 * (2 * width + dv) + 3 * 4 * heads) + 3 * 4 * heads * dv
    return max(1, torch_path.CHUNK_BYTES // per_row)


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
