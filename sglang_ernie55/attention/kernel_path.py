"""The kernel implementation of the `ernie55` backend (`KernelPath`): cache stores, HCA block compression, the
lightning indexer and sparse attention on the project's Triton kernels (`sglang_ernie55.kernels`), with FlashMLA's
sparse decode behind the same `Scope` API where its geometry fits; every geometry `Ernie55Config` accepts runs here
(docs/kernels.md "Geometries", docs/serving-design.md section 6.1).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from ..configuration import LAYER_HCA, LAYER_MLA_DSA
from ..kernels.decode_meta import decode_meta
from ..kernels.hca_compress import hca_compress_store, hca_state_update
from ..kernels.hca_meta import hca_indices
from ..kernels.indexer import (
    LOGITS_DECODE,
    LOGITS_EXTEND,
    TOPK_CONFIGS,
    indexer_logits,
    indexer_topk,
    indexer_topk_torch,
)
from ..kernels.kv_store import kv_load, kv_store
from ..kernels.sparse_attn import Scope, flashmla_sparse_attention, sparse_mqa_attention
from ..layers.rope import cos_sin
from .interface import HCAInputs, LayerInputs, MLAInputs, TokenRows

logger = logging.getLogger(__name__)

# query rows x key columns of one indexer chunk (64 MiB of fp32 logits): decode graphs are captured at the full
# context width, where one [batch, context] chunk would take GiBs at 1M tokens
INDEXER_LOGITS_BUDGET = 1 << 24
ATTN_ROWS = (
    1 << 15
)  # query rows per attention call (the split kernel's grid puts tokens on CUDA's y axis, < 65536)
FLASHMLA_TOPK_ALIGN = 64  # FlashMLA reads index rows in blocks of 64 (pad with -1)
FLASHMLA_HEADS = (64, 128)  # FlashMLA's sparse decode: q heads (after padding)
# MLA-DSA extend on FlashMLA's sparse prefill kernel: rows of the bf16 copy of the batch's latent rows (its
# requests' pages, dequantised once per layer): 75.5 MiB at 576 values; batches past it take the decode kernel
MLA_DENSE_ROWS = 1 << 16
# --enable-deterministic-inference: keys per attention split, fixed, so that a query's result depends only on
# its own keys (kernels/sparse_attn.py `split_keys`); 256 is the default mode's minimum split
DETERMINISTIC_SPLIT_KEYS = 256


@dataclasses.dataclass
class KernelMeta:
    """Index rows of one forward, built once (`KernelPath.extend_meta` / `fixed_meta`) and read by every layer.

    T query tokens of B requests; int32 unless noted. Padded CUDA-graph rows are ordinary rows here
    (their outputs are discarded) except that `st_req` is -1 and their jobs have out slot -1."""

    tok_req: torch.Tensor  # [T] batch row of each query token
    tok_pos: torch.Tensor  # [T] its position
    loc: torch.Tensor  # [T] full-pool slot its KV goes to (out_cache_loc; int64)
    win_loc: torch.Tensor  # [T] window-pool slot of the same token (window_slots(loc))
    page_table: torch.Tensor  # [B, pages] full-pool page of position s of row b: page_table[b, s // page]
    win_idx: torch.Tensor  # [T, window] window-pool slots, -1 padded
    win_len: torch.Tensor  # [T]
    cmp_idx: torch.Tensor  # [T, cmp width] compressed-pool slots, -1 padded (width % 64 == 0)
    cmp_len: torch.Tensor  # [T]
    jobs: tuple[torch.Tensor, ...]  # (req slot, block, ext start, tok start, out slot) [J] (out -1: none)
    st_req: torch.Tensor  # [T] state slot of each token (-1: padded row, writes nothing)
    st_seq: torch.Tensor  # [T] its request's sequence length after the batch
    mla_chunks: tuple[tuple[int, int, int], ...]  # (t0, t1, logits width) query chunks of the indexer
    # indexer_logits' launch config (kernels/indexer.py)
    index_config: tuple[int, ...] = LOGITS_DECODE
    # FlashMLA sparse prefill (extend batches, else None): the batch's latent rows as one bf16 copy, each request's
    # pages in turn. dense_loc [pages * page] full-pool slot of each copy row (int64, -1 past the request's
    # length); dense_pt [B, pages] copy page of position s of row b (the top-k's page table into the copy)
    dense_loc: torch.Tensor | None = None
    dense_pt: torch.Tensor | None = None
    # FlashMLA sparse prefill of the HCA layers (extend batches with `KernelPath.hca_prefill`, else None): one
    # bf16 copy of the batch's window rows (hca_win_loc: window-pool slots, int64), then its compressed rows
    # (hca_cmp_loc: compressed-pool slots, int64); hca_sel [T, window + cmp width] each query's copy rows (its
    # window rows, then its compressed ones; -1 padded), the same keys as win_idx / cmp_idx
    hca_win_loc: torch.Tensor | None = None
    hca_cmp_loc: torch.Tensor | None = None
    hca_sel: torch.Tensor | None = None
    sched: dict = dataclasses.field(default_factory=dict)  # FlashMLA schedules, fresh per forward

    @property
    def num_tokens(self) -> int:
        return self.tok_req.shape[0]


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def window_slots(pool, full: torch.Tensor) -> torch.Tensor:
    """Full-pool slots (any shape, -1 = none) -> window-pool slots: the one translation of the window
    rows. Identity for a pool without `window_loc` (the window kept in the full pool)."""
    to_window = getattr(pool, "window_loc", None)
    if to_window is None:
        return full
    return torch.where(full >= 0, to_window(full.clamp_min(0)), full)


def _jobs(req_to_token, req, P, L, tok_start, nj: int, ratio: int, valid):
    """Compression jobs of blocks that complete in (P, L], nj candidates per request (static), on the
    device. req / P / L / tok_start / valid: [B]. Returns the 5 job tensors (int32 [B * nj])."""
    j = torch.div(P, ratio, rounding_mode="floor")[:, None] + torch.arange(nj, device=P.device)[None, :]
    ok = ((j + 1) * ratio <= L[:, None]) & valid[:, None]
    first = (j * ratio).clamp(max=req_to_token.shape[1] - 1)
    out = torch.where(ok, torch.div(req_to_token[req[:, None], first], ratio, rounding_mode="floor"), -1)
    shape = j.shape
    return tuple(
        t.expand(shape).reshape(-1).to(torch.int32).contiguous()
        for t in (req[:, None], j, P[:, None], tok_start[:, None], out)
    )


def _mla_chunks(ext: list[int], seq: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive query chunks (t0, t1, width): width = the longest sequence among the chunk's requests,
    rows x width <= INDEXER_LOGITS_BUDGET (at least one row per chunk), rows <= ATTN_ROWS."""
    out: list[tuple[int, int, int]] = []
    t0 = t = width = 0
    for e, L in zip(ext, seq):
        done = 0
        while done < e:
            w = max(width, L)
            cap = min(ATTN_ROWS, max(1, INDEXER_LOGITS_BUDGET // w))
            if t - t0 >= cap:  # the open chunk is full at this width: close it
                out.append((t0, t, width))
                t0, width = t, 0
                continue
            n = min(e - done, cap - (t - t0))
            t, done, width = t + n, done + n, w
    if t > t0:
        out.append((t0, t, width))
    return out


def _pad_heads(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """q [T, h, D] with zero heads appended up to FlashMLA's next head count; returns it and the pad."""
    h = q.shape[1]
    pad = next(x for x in FLASHMLA_HEADS if x >= h) - h
    return (torch.nn.functional.pad(q, (0, 0, 0, pad)) if pad else q), pad


def _flashmla(
    meta: KernelMeta,
    key,
    q: torch.Tensor,
    main: Scope,
    extra: Scope | None,
    scale: float,
    d_v: int,
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """flashmla_sparse_attention with the heads padded to 64 / 128 and the forward's shared schedule."""
    import flash_mla

    h = q.shape[1]
    q, pad = _pad_heads(q)
    if sink is not None and pad:
        sink = torch.nn.functional.pad(sink, (0, pad))
    sched = meta.sched.get(key)
    if sched is None:
        sched = meta.sched[key] = flash_mla.get_mla_metadata()[0]
    o, _ = flashmla_sparse_attention(
        q.to(torch.bfloat16).contiguous(), main, extra, sm_scale=scale, d_v=d_v, sink=sink, sched_meta=sched
    )
    return o[:, :h]


def _flashmla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    sel: torch.Tensor,
    scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashMLA's sparse prefill (the legacy SM90 kernel) over the bf16 copy kv [rows, 1, D] at copy rows sel
    [T, topk] (-1: none), heads padded to 64 / 128; sink: fp32 [h] (the HCA layers' attention sink). Returns o
    [T, h, d_v] bf16."""
    import flash_mla

    T, h, _ = q.shape
    q, pad = _pad_heads(q.to(torch.bfloat16))
    if sink is not None and pad:
        sink = torch.nn.functional.pad(sink, (0, pad))
    o = flash_mla.flash_mla_sparse_fwd(
        q.contiguous(), kv, sel.view(T, 1, -1), scale, d_v, attn_sink=sink, use_legacy=True
    )[0]
    return o[:, :h]


def sparse_prefill_runs(topk: int) -> bool:
    """Whether FlashMLA's sparse prefill can serve MLA-DSA extend rows here: its legacy SM90 kernel (the one that
    reads d_qk 576) loads on an SM90 GPU, and the top-k rows come in blocks of 64."""
    if topk % FLASHMLA_TOPK_ALIGN:
        return False
    try:
        import flash_mla

        return bool(flash_mla.has_legacy()) and torch.cuda.get_device_capability()[0] == 9
    except Exception:  # noqa: BLE001 (not installed, no CUDA: the decode kernel serves extend rows)
        return False


def fused_meta_mismatch(path, dev) -> str:
    """'' when `fused_fixed_meta` equals `fixed_meta` field for field on synthetic batches on `dev` at `path`'s
    window, ratio and page size (shuffled pages, a padded row, positions inside and past the window and the
    first compression blocks), else which field differs in which case."""
    from types import SimpleNamespace

    page = path.page_size
    g = torch.Generator().manual_seed(0)
    slots, width = 3, 4 * page
    pages = torch.randperm(4 * slots + 2, generator=g)[: slots * 4] + 2  # page 0 stays SGLang's padding page
    r2t = (pages.view(slots, 4, 1) * page + torch.arange(page)).view(slots, width).to(torch.int32).to(dev)
    mapping = torch.randperm((4 * slots + 4) * page, generator=g).to(dev)
    cfg = SimpleNamespace(window_size=path.W, compress_ratio=path.ratio, index_topk=path.topk)
    for mapped in (False, True):
        pool = SimpleNamespace(page_size=page, is_hybrid_swa=mapped, full_to_swa_index_mapping=mapping)
        pool.window_loc = (lambda full: mapping[full.long()]) if mapped else None
        twin = KernelPath(pool, r2t, cfg, fused_meta=False, fused_topk=False)
        for per_req in (1, 3):
            req = torch.tensor([2, 0, 1], device=dev)
            seq = torch.tensor([3 * page - 5, per_req + 1, 2 * page + path.ratio], device=dev)
            loc = torch.stack([r2t[r, int(L) - per_req : int(L)].long() for r, L in zip(req.tolist(), seq)])
            loc[1] = torch.arange(per_req, device=dev)  # a padded graph row (SGLang's padding page)
            loc = loc.reshape(-1)
            want = twin.fixed_meta(req, seq, loc, per_req, width)
            got = twin.fused_fixed_meta(req, seq - per_req, per_req, loc, per_req, width)
            field = meta_difference(want, got)
            if field:
                return f"{field}, {per_req} rows per request, window mapping {'on' if mapped else 'off'}"
    return ""


def fused_topk_mismatch(path, dev) -> str:
    """'' when `indexer_topk` selects the same cache slots as `indexer_topk_torch` (as sets; the kernel writes them
    in position order) with the same lengths and -1 padding, on synthetic logits on `dev` at `path`'s top-k and
    page size: rows shorter and longer than the top-k, many equal logits across the cut, -0.0 beside +0.0,
    a row stride wider than the row, shuffled pages; else what differs in which row."""
    page, topk = path.page_size, path.topk
    g = torch.Generator().manual_seed(0)
    width = 2 * topk + page + 37
    n_pages = -(-width // page)
    pt = (torch.randperm(3 * n_pages, generator=g)[: 2 * n_pages] + 1).view(2, n_pages).to(torch.int32)
    q_pos = torch.tensor([width - 1, topk - 1, topk, 5, width - 2], dtype=torch.int32)
    q_req = torch.tensor([0, 1, 0, 1, 1], dtype=torch.int32)
    buf = torch.randn(len(q_pos), width + 9, generator=g)
    buf[:, ::3] = buf[:, 1:2]  # a third of each row ties one value
    buf[:, 1::7] = 0.0
    buf[:, 2::7] = -0.0
    logits = buf[:, :width]
    logits[torch.arange(width)[None, :] > q_pos[:, None].long()] = float("-inf")
    args = [x.to(dev) for x in (logits, q_pos, q_req, pt)]
    want, want_n = indexer_topk_torch(args[0], args[1], topk, args[3], args[2], page)
    want, want_n = want.cpu(), want_n.cpu()
    for _rows, config in TOPK_CONFIGS:  # each launch configuration serving may pick
        got, got_n = indexer_topk(args[0], args[1], topk, args[3], args[2], page, config=config)
        got, got_n = got.cpu(), got_n.cpu()
        for t in range(len(q_pos)):
            n = int(want_n[t])
            if int(got_n[t]) != n:
                return f"row {t}: length {int(got_n[t])}, torch {n} (config {config})"
            if sorted(got[t, :n].tolist()) != sorted(want[t, :n].tolist()) or (got[t, n:] != -1).any():
                return f"row {t}: the selected slots (q_pos {int(q_pos[t])}, top-k {topk}, config {config})"
    return ""


def meta_difference(want: KernelMeta, got: KernelMeta) -> str:
    """The first field in which two metadata differ (dtype, shape or any value; the FlashMLA schedules, which
    the first layer fills, aside), or ''."""
    for f in dataclasses.fields(KernelMeta):
        if f.name == "sched":
            continue
        a, b = getattr(want, f.name), getattr(got, f.name)
        if a is None or b is None:
            same = a is None and b is None
        elif f.name in ("mla_chunks", "index_config"):
            same = a == b
        else:
            xs, ys = (a, b) if f.name == "jobs" else ((a,), (b,))
            same = len(xs) == len(ys) and all(
                x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(xs, ys)
            )
        if not same:
            return f.name
    return ""


class KernelPath:
    """The kernel implementation of the layer kinds the backend gives it: one `KernelMeta` per forward, the
    compression cos / sin table, and one call per layer (HCA: store, compress, attend; MLA-DSA: store, index,
    attend). `flashmla`: the kinds whose attention runs on FlashMLA (the others on the Triton split kernel);
    `split_keys`: the batch-invariant key splits of --enable-deterministic-inference (None: free splits);
    `query_dtype`: the MMA operand dtype of the queries (bf16; fp32 with fp32 activations, the exactness runs).

    The `KernelMeta` of a forward holds every index row the layers read, built on the device from
    `req_to_token` (no per-token host work; extend copies its two host length lists once, decode and its CUDA
    graphs make no host sync):

    - window rows: slots of positions max(0, p-W+1) .. p, through `window_slots` (the one place that maps
      full-pool slots to window-pool slots), compressed rows: slots of blocks j < (p+1) // ratio, both `-1`
      padded with lengths (kernels/hca_meta.py `hca_indices`);
    - compression jobs: one per block that completes in the batch, built on the device with a static count per
      request (`ceil(max new tokens / ratio)`; unused jobs have out slot -1), and the per-token state-update
      rows; `compress` is the one call site of the compression kernels;
    - the page table of the batch's requests (the indexer reads keys through it), and the query chunks of the
      indexer (extend: bounded [chunk, keys] logits, never [queries, heads, keys]);
    - FlashMLA tile-scheduler metadata, one fresh `FlashMLASchedMeta` per (layer kind, chunk) and forward: the
      first layer's call fills it (inside the CUDA graph when captured, so replays recompute it), later layers
      reuse it (same shapes and lengths in every layer of a kind).

    Padded CUDA-graph rows (out_cache_loc in SGLang's padding page, slot < page_size) write their window / latent
    rows into that page, run no compression job and write no state row."""

    def __init__(
        self,
        pool,
        req_to_token: torch.Tensor,
        cfg,
        flashmla: frozenset[str] = frozenset(),
        split_keys: int | None = None,
        query_dtype: torch.dtype = torch.bfloat16,
        fused_meta: bool | None = None,
        fused_topk: bool | None = None,
    ):
        """fused_meta: build decode / verify rows with `fused_fixed_meta`; fused_topk: select the indexer's top-k
        with `indexer_topk` (else `indexer_topk_torch`). None: where the start-up check (`_fused_works`) passes."""
        self.pool, self.req_to_token = pool, req_to_token
        self.page_size = pool.page_size
        self.W, self.ratio, self.topk = cfg.window_size, cfg.compress_ratio, cfg.index_topk
        self.flashmla, self.split_keys, self.query_dtype = frozenset(flashmla), split_keys, query_dtype
        # page starts of every request slot (a view): page_table = page_starts[req] // page_size
        self.page_starts = req_to_token[:, :: self.page_size]
        self.meta: KernelMeta | None = None
        self._rope_tables: dict = {}
        self.fused_meta = self._fused_meta_works() if fused_meta is None else fused_meta
        self.fused_topk = self._fused_topk_works() if fused_topk is None else fused_topk
        from ..envs import hca_sparse_prefill, indexer_extend_config, mla_sparse_prefill

        self.index_extend = indexer_extend_config() or LOGITS_EXTEND
        self.mla_prefill = (
            LAYER_MLA_DSA in self.flashmla and mla_sparse_prefill() and sparse_prefill_runs(self.topk)
        )
        # a query's HCA keys: its window (W wide) then its compressed entries (widths of 64)
        self.hca_prefill = LAYER_HCA in self.flashmla and hca_sparse_prefill() and sparse_prefill_runs(self.W)

    # ------------------------------------------------------------------ metadata
    def init_extend(self, fb, split=None) -> None:
        if split is not None:
            raise NotImplementedError(
                "ernie55 backend: the kernel attention path does not attend a CP rank's own query rows (its "
                "metadata covers every token of the batch); attention CP (--attn-cp-size with --enable-prefill-cp) "
                "runs on the torch path. Serve without --attn-cp-size. See docs/serving-design.md section 8.2."
            )
        self.meta = self.extend_meta(fb)

    def init_rows(self, rows: TokenRows) -> None:
        if self.fused_meta:
            add = 0 if rows.counted else rows.per_req
            self.meta = self.fused_fixed_meta(
                rows.req, rows.seq_lens, add, rows.loc, rows.per_req, rows.width
            )
        else:
            self.meta = self.fixed_meta(rows.req, rows.seq_after, rows.loc, rows.per_req, rows.width)

    def init_graph_host(self, per_req: int, width: int) -> None:
        """Nothing on the host: the index rows are device ops, recorded into the graph (`init_graph_device`)."""

    def init_graph_device(self, rows: TokenRows) -> None:
        """The index rows from the runner's static buffers with context-length widths, and an empty FlashMLA
        schedule that the captured first layer of each kind fills."""
        self.init_rows(rows)

    def _common(
        self,
        req,
        P,
        L,
        tok_req,
        tok_pos,
        tok_start,
        loc,
        valid_tok,
        valid_req,
        cmp_width: int,
        nj: int,
        mla_chunks,
        index_config: tuple[int, ...] = LOGITS_DECODE,
    ) -> KernelMeta:
        """req (pool rows) / P (prefix) / L (seq len) / tok_start [B]; tok_req / tok_pos / loc / valid_tok [T]."""
        page, ratio = self.page_size, self.ratio
        pt = self.page_starts[req.long()]
        pt = torch.div(pt, page, rounding_mode="floor").to(torch.int32)
        widx, wlen, cidx, clen = hca_indices(
            pt, pt, tok_req, tok_pos, cmp_width, window=self.W, ratio=ratio, page_size=page
        )
        loc = loc.long()
        jobs = _jobs(self.req_to_token, req.long(), P, L, tok_start, nj, ratio, valid_req)
        st_req = torch.where(valid_tok, req.long()[tok_req.long()], -1).to(torch.int32)
        return KernelMeta(
            tok_req=tok_req.to(torch.int32).contiguous(),
            tok_pos=tok_pos.to(torch.int32).contiguous(),
            loc=loc,
            win_loc=window_slots(self.pool, loc),
            page_table=pt.contiguous(),
            win_idx=window_slots(self.pool, widx).to(torch.int32).contiguous(),
            win_len=wlen,
            cmp_idx=cidx,
            cmp_len=clen,
            jobs=jobs,
            st_req=st_req,
            st_seq=L.long()[tok_req.long()].to(torch.int32),
            mla_chunks=tuple(mla_chunks),
            index_config=index_config,
        )

    def fixed_meta(self, req, seq_after, loc, per_req: int, width: int) -> KernelMeta:
        """`per_req` new tokens per request at positions seq_after - per_req .. seq_after - 1 (decode: 1; a
        verify pass: its draft width), CUDA-graph safe: device ops on the runner's buffers only. req /
        seq_after [B]; loc [B * per_req] request-major. `width`: static upper bound of the sequence lengths
        (the context length under graphs)."""
        B, dev = req.shape[0], req.device
        L = seq_after.long()
        P = L - per_req
        tok_req = torch.arange(B, device=dev).repeat_interleave(per_req)
        tok_pos = P[tok_req] + torch.arange(per_req, device=dev).repeat(B)
        valid = loc >= self.page_size  # padded graph rows point into SGLang's padding page
        valid_req = valid.view(B, per_req)[:, 0] if B else valid
        cmp_width = _ceil_to(max(1, -(-width // self.ratio)), FLASHMLA_TOPK_ALIGN)
        nj = -(-per_req // self.ratio)
        start = torch.arange(B, device=dev) * per_req
        return self._common(
            req,
            P,
            L,
            tok_req,
            tok_pos,
            start,
            loc,
            valid,
            valid_req,
            cmp_width,
            nj,
            _mla_chunks([per_req] * B, [width] * B),
        )

    def _window_mapping(self) -> torch.Tensor | None:
        """The full -> window slot mapping `window_slots` gathers through (None: the window rows live in the
        full pool)."""
        if getattr(self.pool, "window_loc", None) is None or not getattr(self.pool, "is_hybrid_swa", False):
            return None
        m = self.pool.full_to_swa_index_mapping
        if m is None:
            self.pool.window_loc(torch.zeros(0, dtype=torch.int64))  # raises the pool's own error
        return m

    def fused_fixed_meta(self, req, seq_lens, seq_add: int, loc, per_req: int, width: int) -> KernelMeta:
        """`fixed_meta` (sequence lengths after the batch: seq_lens + seq_add) in one Triton launch
        (kernels/decode_meta.py), field for field the same."""
        B = req.shape[0]
        f = decode_meta(
            req,
            seq_lens,
            loc.long(),
            self.req_to_token,
            self._window_mapping(),
            per_req=per_req,
            seq_add=seq_add,
            window=self.W,
            ratio=self.ratio,
            page_size=self.page_size,
            cmp_width=_ceil_to(max(1, -(-width // self.ratio)), FLASHMLA_TOPK_ALIGN),
        )
        return KernelMeta(loc=loc.long(), mla_chunks=tuple(_mla_chunks([per_req] * B, [width] * B)), **f)

    def _fused_meta_works(self) -> bool:
        """Whether to build fixed-shape batches with `fused_fixed_meta`: it must equal `fixed_meta` on a small
        synthetic batch here, at this path's window, ratio and page size, with and without a window mapping,
        one and three rows per request (a padded row included). Checked once, at start-up, because a decode
        graph records the metadata build."""
        from ..envs import fused_decode_meta

        return self._fused_works(
            fused_decode_meta(),
            fused_meta_mismatch,
            "the fused decode metadata build differs from the torch build",
            "decode and verify batches build their index rows in torch ops instead",
        )

    def _fused_topk_works(self) -> bool:
        """Whether the indexer's top-k runs as one launch (`indexer_topk`): it must select what
        `indexer_topk_torch` selects on synthetic logits here (`fused_topk_mismatch`)."""
        from ..envs import fused_topk

        return self._fused_works(
            fused_topk(),
            fused_topk_mismatch,
            "the one-launch indexer top-k differs from the torch top-k",
            "the MLA-DSA layers select their keys in torch ops instead",
        )

    def _fused_works(self, enabled: bool, mismatch, differs: str, instead: str) -> bool:
        """A fused kernel serves where it is enabled, where Triton runs (a CUDA device, or the interpreter) and
        where `mismatch(self, dev)` finds no difference from its torch twin on the serving device; on any
        difference or error the torch twin serves, with a warning naming what differed."""
        dev = self.req_to_token.device
        if not enabled or (dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
            return False
        try:
            bad = mismatch(self, dev)
        except Exception as e:  # noqa: BLE001 (any failure: the torch twin is always right)
            bad = f"{type(e).__name__}: {e}"
        if bad:
            logger.warning(f"ernie55 kernel path: {differs} on {dev} ({bad}); {instead}")
        return not bad

    def extend_meta(self, fb) -> KernelMeta:
        """Extend (prefill, chunked prefill, prefix hits, mixed batches): ragged rows from the host lists."""
        prefix = [int(x) for x in fb.extend_prefix_lens_cpu]
        ext = [int(x) for x in fb.extend_seq_lens_cpu]
        req, loc = fb.req_pool_indices, fb.out_cache_loc
        dev, B, T = req.device, len(ext), sum(ext)
        lens = torch.tensor([prefix, ext], dtype=torch.int64).to(dev, non_blocking=True)
        P, E = lens[0], lens[1]
        L = P + E
        tok_req = torch.repeat_interleave(torch.arange(B, device=dev), E, output_size=T)
        start = torch.cumsum(E, 0) - E
        tok_pos = P[tok_req] + torch.arange(T, device=dev) - start[tok_req]
        seq = [p + e for p, e in zip(prefix, ext)]
        cmp_width = _ceil_to(max(1, -(-max(seq, default=1) // self.ratio)), FLASHMLA_TOPK_ALIGN)
        nj = max(1, -(-max(ext, default=1) // self.ratio))
        valid_tok = torch.ones(T, dtype=torch.bool, device=dev)
        valid_req = torch.ones(B, dtype=torch.bool, device=dev)
        meta = self._common(
            req,
            P,
            L,
            tok_req,
            tok_pos,
            start,
            loc,
            valid_tok,
            valid_req,
            cmp_width,
            nj,
            _mla_chunks(ext, seq),
            self.index_extend,
        )
        if self.mla_prefill:
            pages = [-(-x // self.page_size) for x in seq]
            if sum(pages) * self.page_size <= MLA_DENSE_ROWS:
                meta.dense_loc, meta.dense_pt = self.dense_rows(meta.page_table, L, pages)
        if self.hca_prefill:
            self.hca_rows(meta, req, prefix, seq)
        return meta

    def hca_rows(self, meta: KernelMeta, req, prefix: list[int], seq: list[int]) -> None:
        """`KernelMeta`'s hca_* fields for an extend batch (P_b = prefix[b], L_b = seq[b]): request b's window
        rows, positions max(0, P_b - W + 1) .. L_b - 1, in turn, then its compressed entries
        0 .. L_b // ratio - 1 in turn; each query (request b, position p) takes rows p - W + 1 .. p (those
        >= 0) and entries 0 .. (p + 1) // ratio - 1 of its request: `hca_indices`'s keys in the pools."""
        W, ratio, dev = self.W, self.ratio, req.device
        wfirst = [max(0, p - W + 1) for p in prefix]
        nw = [L_ - f for L_, f in zip(seq, wfirst)]
        nc = [L_ // ratio for L_ in seq]
        B, Nw, Nc = len(seq), sum(nw), sum(nc)
        host = torch.tensor([wfirst, nw, nc], dtype=torch.int64).to(dev, non_blocking=True)
        wf, nwd, ncd = host[0], host[1], host[2]
        wbase, cbase = torch.cumsum(nwd, 0) - nwd, torch.cumsum(ncd, 0) - ncd
        rq = req.long()
        # the copy's window rows: full slot of (request, position) -> window slot
        b = torch.repeat_interleave(torch.arange(B, device=dev), nwd, output_size=Nw)
        pos = wf[b] + torch.arange(Nw, device=dev) - wbase[b]
        meta.hca_win_loc = window_slots(self.pool, self.req_to_token[rq[b], pos].long())
        # the compressed rows: entry j of request b sits at cmp page page_table[b, j // E], slot j % E
        per_page = self.page_size // ratio
        b = torch.repeat_interleave(torch.arange(B, device=dev), ncd, output_size=Nc)
        j = torch.arange(Nc, device=dev) - cbase[b]
        meta.hca_cmp_loc = meta.page_table.long()[b, j // per_page] * per_page + j % per_page
        # each query's rows in the copy
        tb, p = meta.tok_req.long(), meta.tok_pos.long()
        s = p[:, None] - torch.arange(W, device=dev)[None, :]  # newest first: the rows >= 0 lead
        win = torch.where(s >= 0, wbase[tb][:, None] + s - wf[tb][:, None], -1)
        k = torch.arange(meta.cmp_idx.shape[1], device=dev)[None, :]
        cmp = torch.where(k < ((p + 1) // ratio)[:, None], Nw + cbase[tb][:, None] + k, -1)
        meta.hca_sel = torch.cat([win, cmp], 1).to(torch.int32).contiguous()

    def dense_rows(self, page_table, L, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense_loc, dense_pt) of `KernelMeta` for requests of lengths L [B] (device) spanning `pages` pages
        (host): request b's pages follow those of requests < b in the copy."""
        page, dev = self.page_size, page_table.device
        B, total = len(pages), sum(pages)
        n = torch.tensor(pages, dtype=torch.int64).to(dev, non_blocking=True)
        base = torch.cumsum(n, 0) - n
        width = page_table.shape[1]
        dense_pt = (base[:, None] + torch.arange(width, device=dev)[None, :]).to(torch.int32)
        b = torch.repeat_interleave(torch.arange(B, device=dev), n, output_size=total)
        j = torch.arange(total, device=dev) - base[b]
        off = torch.arange(page, device=dev)
        slot = page_table[b, j].long()[:, None] * page + off[None, :]
        inside = (j[:, None] * page + off[None, :]) < L.long()[b][:, None]
        return torch.where(inside, slot, -1).view(-1), dense_pt.contiguous()

    def rope_tables(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin fp32 [context, rope / 2] of the model's RoPE table (the compression kernel's), built at the
        first call (in the warm-up before any graph capture)."""
        key = (inv_freq.device, inv_freq.data_ptr())
        if key not in self._rope_tables:
            pos = torch.arange(self.req_to_token.shape[1], device=inv_freq.device)
            self._rope_tables[key] = tuple(t.contiguous() for t in cos_sin(pos, inv_freq.float()))
        return self._rope_tables[key]

    # ------------------------------------------------------------------ layers
    def extend(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        return self._layer(kind, q, kv, inputs, layer)

    def rows(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        return self._layer(kind, q, kv, inputs, layer)

    def _layer(self, kind: str, q, kv, inputs: LayerInputs, layer) -> torch.Tensor:
        m = self.meta
        if m is None or m.num_tokens != q.shape[0]:
            raise RuntimeError(
                f"ernie55 backend: kernel metadata for {None if m is None else m.num_tokens} tokens, the layer "
                f"has {q.shape[0]} (init_forward_metadata must run for every forward)"
            )
        if kind == LAYER_HCA:
            return self.hca(m, q, kv, inputs, layer)
        return self.mla(m, q, kv, inputs, layer)

    def compress(self, meta: KernelMeta, lid: int, cs: torch.Tensor, compressor) -> None:
        """HCA block compression of one layer: every block that completes in this batch -> its compressed
        entry (in the pool's layout), then the rows of each request's open block -> the state. The one
        call site of the compression kernels (kernels/hca_compress.py)."""
        cmp, state = self.pool.cmp[lid], self.pool.state[lid]
        cos, sin = self.rope_tables(compressor.inv_freq)
        w = compressor.norm.weight
        # the layer's rows as they are (fp32 / bf16, a column slice of its merged projection): the kernels read
        # them as fp32
        kvs = cs if cs.stride(-1) == 1 else cs.contiguous()
        hca_compress_store(
            cmp.pool,
            cmp.geom,
            kvs,
            state,
            compressor.ape.float().contiguous(),
            w.float().contiguous(),
            compressor.eps,
            cos,
            sin,
            *meta.jobs,
        )
        hca_state_update(state, kvs, meta.tok_pos, meta.st_req, meta.st_seq, ratio=self.ratio)

    def hca(self, meta: KernelMeta, q, kv, inputs: HCAInputs, layer) -> torch.Tensor:
        """Store the window kv, compress completed blocks, attend window + compressed entries + sink.
        q [T, h, D] (normed, roped), kv [T, D], inputs.cs [T, 2D]. Returns o [T, h, D] (rope slice still
        rotated: the layer applies the inverse RoPE): fp32, or FlashMLA's own bf16 output when one FlashMLA call
        serves every row (no fp32 copy: the layer's next step rounds o to its bf16 `wo_a` anyway)."""
        lid = layer.layer_id
        win, cmp = self.pool.win[lid], self.pool.cmp[lid]
        T, h, D = q.shape
        if T == 0:
            return q.new_zeros(0, h, D, dtype=torch.float32)
        kv_store(win.pool, win.geom, meta.win_loc, kv.reshape(T, -1).contiguous())
        self.compress(meta, lid, inputs.cs, inputs.compressor)
        qb = q.to(self.query_dtype).contiguous()
        sink = inputs.sink.float().contiguous()
        if meta.hca_sel is not None:
            # the batch's window and compressed rows as one bf16 copy, once per layer
            Nw, Nc = meta.hca_win_loc.shape[0], meta.hca_cmp_loc.shape[0]
            kv_dense = torch.empty(Nw + Nc, D, dtype=torch.bfloat16, device=q.device)
            kv_load(win.pool, win.geom, meta.hca_win_loc, out=kv_dense[:Nw])
            kv_load(cmp.pool, cmp.geom, meta.hca_cmp_loc, out=kv_dense[Nw:])
            return _flashmla_prefill(qb, kv_dense.unsqueeze(1), meta.hca_sel, layer.scaling, D, sink)
        flashmla = LAYER_HCA in self.flashmla
        single = flashmla and T <= ATTN_ROWS
        out = None if single else torch.empty(T, h, D, dtype=torch.float32, device=q.device)
        for ci, t0 in enumerate(range(0, T, ATTN_ROWS)):
            t1 = min(T, t0 + ATTN_ROWS)
            main = Scope(win.pool, win.geom, meta.win_idx[t0:t1], meta.win_len[t0:t1])
            extra = Scope(cmp.pool, cmp.geom, meta.cmp_idx[t0:t1], meta.cmp_len[t0:t1])
            if flashmla:
                o = _flashmla(meta, ("hca", ci), qb[t0:t1], main, extra, layer.scaling, D, sink)
                if single:
                    return o
                out[t0:t1] = o
            else:
                sparse_mqa_attention(
                    qb[t0:t1],
                    main,
                    extra,
                    sm_scale=layer.scaling,
                    d_v=D,
                    sink=sink,
                    out=out[t0:t1],
                    split_keys=self.split_keys,
                )
        return out

    def mla(self, meta: KernelMeta, q, kc, inputs: MLAInputs, layer) -> torch.Tensor:
        """Store [latent | k_pe] and the indexer key, then per query chunk: indexer logits over the paged
        key pool, exact top-k (ties to the earlier position) as latent-pool slots, sparse absorbed MLA.
        q [T, h, R + r] (= [q_nope W_uk | q_pe]), kc [T, R + r], inputs: index_q [T, nI, dI], index_w [T, nI],
        index_k [T, dI]. Returns o_latent [T, h, R]: fp32, or FlashMLA's own bf16 output when one indexer chunk
        covers every row (as `hca`)."""
        lid = layer.layer_id
        lat, idx = self.pool.latent[lid], self.pool.index_k[lid]
        T, h, _ = q.shape
        R = layer.v_head_dim
        if T == 0:
            return q.new_zeros(0, h, R, dtype=torch.float32)
        kv_store(lat.pool, lat.geom, meta.loc, kc.reshape(T, -1).contiguous())
        kv_store(idx.pool, idx.geom, meta.loc, inputs.index_k.contiguous())
        qb = q.to(self.query_dtype).contiguous()
        iqb = inputs.index_q.to(self.query_dtype).contiguous()
        iw = inputs.index_w.float().contiguous()
        flashmla = LAYER_MLA_DSA in self.flashmla
        single = flashmla and len(meta.mla_chunks) == 1
        out = None if single else torch.empty(T, h, R, dtype=torch.float32, device=q.device)
        dense = meta.dense_loc is not None and flashmla
        if dense:  # the batch's latent rows as bf16, once per layer (exact: fp8 times power-of-two scales)
            kv_dense = kv_load(lat.pool, lat.geom, meta.dense_loc).unsqueeze(1)
        page_table = meta.dense_pt if dense else meta.page_table
        for ci, (t0, t1, width) in enumerate(meta.mla_chunks):
            req, pos = meta.tok_req[t0:t1], meta.tok_pos[t0:t1]
            logits = indexer_logits(
                iqb[t0:t1],
                iw[t0:t1],
                idx.pool,
                idx.geom,
                meta.page_table,
                req,
                pos,
                width,
                config=meta.index_config,
            )
            topk = indexer_topk if self.fused_topk else indexer_topk_torch
            sel, n = topk(logits, pos, self.topk, page_table, req, self.page_size)
            del logits
            if dense:
                o = _flashmla_prefill(qb[t0:t1], kv_dense, sel, layer.scaling, R)
                if single:
                    return o
                out[t0:t1] = o
                continue
            main = Scope(lat.pool, lat.geom, sel, n)
            if flashmla:
                o = _flashmla(meta, ("mla", ci), qb[t0:t1], main, None, layer.scaling, R, None)
                if single:
                    return o
                out[t0:t1] = o
            else:
                sparse_mqa_attention(
                    qb[t0:t1],
                    main,
                    None,
                    sm_scale=layer.scaling,
                    d_v=R,
                    out=out[t0:t1],
                    split_keys=self.split_keys,
                )
        return out
