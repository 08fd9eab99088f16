"""The torch compute of the `ernie55` backend: the CPU path, the kernels' oracle inside the backend, and the
fallback on CUDA for geometries no kernel takes. `TorchPath` is the implementation the adapter drives (its
metadata, one layer call per kind); `TorchHCA` / `TorchMLA` are the per-kind computes. Keys are visited in chunks
with an online softmax, so no tensor grows with the context length times the batch (a CUDA graph captured at a
1M-token context stays small); the DSA top-k is a running top-k over the same chunks, and a second pass attends
the keys it selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configuration import LAYER_HCA
from .interface import LayerInputs, TokenRows

# Bytes one chunk of keys may occupy across the rows that read it (gathered rows, their byte-index tensors,
# logits); chunk lengths follow from it.
CHUNK_BYTES = 256 << 20
MIN_CHUNK, MAX_CHUNK = 64, 1 << 16
QUERY_CHUNK = 256  # extend: queries per block


@dataclass
class ExtendMeta:
    """An EXTEND batch: request slots, prefix and extend lengths. Under SGLang's prefill CP (attention.cp) the
    keys are the whole batch's while the queries are one rank's: `qidx` the batch row of each query row,
    `rows` the query rows with padding (None: every batch row is a query row, in order)."""

    req: list[int]
    prefix: list[int]
    extend: list[int]
    qidx: list[int] | None = None
    rows: int = 0

    def query_blocks(self):
        """(request index, query-row index, positions) per block of at most QUERY_CHUNK consecutive-position
        queries of one request; the indices are slices (every row a query) or [n] long tensors (CP rows)."""
        off = 0
        if self.qidx is None:
            for i, (P, E) in enumerate(zip(self.prefix, self.extend)):
                for q0 in range(P, P + E, QUERY_CHUNK):
                    q1 = min(P + E, q0 + QUERY_CHUNK)
                    yield i, slice(off + q0 - P, off + q1 - P), torch.arange(q0, q1)
                off += E
            return
        qidx = torch.tensor(self.qidx, dtype=torch.long)
        for i, (P, E) in enumerate(zip(self.prefix, self.extend)):
            j = torch.nonzero((qidx >= off) & (qidx < off + E)).flatten()  # this request's query rows
            pos = qidx[j] - off + P
            for c0 in range(0, j.numel(), QUERY_CHUNK):
                yield i, j[c0 : c0 + QUERY_CHUNK], pos[c0 : c0 + QUERY_CHUNK]
            off += E

    def query_rows(self, total: int) -> int:
        return total if self.qidx is None else self.rows


@dataclass
class DecodeMeta:
    """DECODE (one row per request) and TARGET_VERIFY (`per_req` rows per request)."""

    width: int  # key positions a row may see (static under CUDA graphs: the context length)
    per_req: int = 1  # query rows per request: 1 (decode) or S+1 (verify)


def key_chunk(rows: int, bytes_per_key: int) -> int:
    """Keys per chunk so that `rows` rows reading `bytes_per_key` each stay within CHUNK_BYTES (a power of two)."""
    n = CHUNK_BYTES // max(1, rows * bytes_per_key)
    n = 1 << max(0, n.bit_length() - 1)
    return max(MIN_CHUNK, min(MAX_CHUNK, n))


def read_cost(rows) -> int:
    """Bytes a gather of one key from `rows` (PackedRows / DenseRows) allocates: the fp32 row, and for packed
    rows the int64 byte index and the raw bytes of `reference.kernels_ref.pool_gather`."""
    geom = getattr(rows, "geom", None)
    return 4 * rows.width + (9 * geom.bytes_per_token if geom is not None else 0)


class OnlineSoftmax:
    """softmax(logits) @ values accumulated over key chunks. A sink (per-head logit with a zero value)
    starts the sum; rows that see no key and no sink return 0."""

    def __init__(self, rows: int, heads: int, dv: int, sink: torch.Tensor | None, device):
        if sink is None:
            self.m = torch.full((rows, heads), float("-inf"), device=device)
            self.l = torch.zeros(rows, heads, device=device)
        else:
            self.m = sink.float()[None, :].expand(rows, heads).clone()
            self.l = torch.ones(rows, heads, device=device)
        self.acc = torch.zeros(rows, heads, dv, device=device)

    def add(self, logits: torch.Tensor, values: torch.Tensor) -> None:
        """logits [R, h, n] (-inf = masked), values [R, n, dv] (per row) or [n, dv] (shared)."""
        m = torch.maximum(self.m, logits.amax(-1))
        safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
        p = torch.exp(logits - safe[..., None])
        scale = torch.exp(self.m - safe)
        pv = (
            torch.einsum("rhn,rnd->rhd", p, values)
            if values.dim() == 3
            else torch.einsum("rhn,nd->rhd", p, values)
        )
        self.acc = self.acc * scale[..., None] + pv
        self.l = self.l * scale + p.sum(-1)
        self.m = m

    def result(self) -> torch.Tensor:
        return self.acc / self.l.clamp_min(1e-30)[..., None]


def _logits(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, h, c]; keys [R, n, c] or [n, c]; mask [R, n] -> [R, h, n] fp32, masked keys -inf."""
    keys = torch.where(mask[..., None], keys, 0.0) if keys.dim() == 3 else keys
    eq = "rhc,rnc->rhn" if keys.dim() == 3 else "rhc,nc->rhn"
    return (torch.einsum(eq, q.float(), keys) * scale).masked_fill(~mask[:, None, :], float("-inf"))


def masked_sink_attention(q, keys, values, mask, sink, scale):
    """One block of keys per row: q [B, h, c], keys [B, S, c], values [B, S, r], mask [B, S], sink [h] or None
    -> [B, h, r] fp32 (the ECHO draft's window attention; S is the window)."""
    acc = OnlineSoftmax(q.shape[0], q.shape[1], values.shape[-1], sink, q.device)
    acc.add(_logits(q, keys, mask, scale), torch.where(mask[..., None], values, 0.0))
    return acc.result()


class RunningTopK:
    """The DSA selection over key chunks: per row the `k` largest indexer scores seen so far with their
    positions, ties to the earlier position (chunks arrive in position order and the sort is stable). After
    the last chunk `selected` tells, for a chunk's scores, which keys the reference's `indexer_topk` selects."""

    def __init__(self, rows: int, k: int, device):
        self.k = k
        self.vals = torch.full((rows, k), float("-inf"), device=device)
        self.pos = torch.full((rows, k), -1, dtype=torch.long, device=device)

    def add(self, scores: torch.Tensor, pos: torch.Tensor) -> None:
        """scores [R, n] (-inf = not a key of that row), pos [n] or [R, n] in increasing order."""
        v = torch.cat([self.vals, scores], 1)
        p = torch.cat([self.pos, pos.expand_as(scores)], 1)
        order = torch.sort(v, dim=1, descending=True, stable=True).indices[:, : self.k]
        self.vals, self.pos = v.gather(1, order), p.gather(1, order)

    def finish(self, n_keys: torch.Tensor) -> None:
        """n_keys [R]: causal keys per row. Rows with at most k keys select all of them; the others select
        scores above the k-th best, and at the k-th best value the positions up to the last one kept."""
        self.all = n_keys <= self.k
        self.t = self.vals[:, -1]
        at_t = self.vals == self.t[:, None]
        self.p = torch.where(at_t, self.pos, torch.full_like(self.pos, -1)).amax(1)

    def selected(self, scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        t, p = self.t[:, None], self.p[:, None]
        return valid & (self.all[:, None] | (scores > t) | ((scores == t) & (pos <= p)))


def _index_scores(iq: torch.Tensor, iw: torch.Tensor, kI: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores sum_h w[r, h] ReLU(iq[r, h] . kI[n]): iq [R, nI, d], iw [R, nI]; kI [R, n, d]
    (per row) or [n, d] (shared) -> [R, n] fp32."""
    if kI.dim() == 2:
        return torch.einsum(
            "th,ths->ts", iw.float(), torch.relu(torch.einsum("thd,sd->ths", iq.float(), kI.float()))
        )
    return torch.einsum("rh,rhn->rn", iw.float(), torch.relu(torch.einsum("rhd,rnd->rhn", iq.float(), kI)))


class TorchHCA:
    """HCA on the pool: window rows + compressed entries + per-head sink; blocks compress from the
    request-scoped open-block state ring (two blocks when speculating: a rejected draft past a block boundary
    must not overwrite the block it would complete)."""

    def __init__(self, pool, req_to_token: torch.Tensor, window: int, ratio: int):
        self.pool, self.req_to_token, self.W, self.ratio = pool, req_to_token, window, ratio

    def _cmp_slots(self, req: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Compressed-entry slot of block(s) `blocks` of request slot(s) `req`: loc of the block's first token // ratio."""
        return torch.div(self.req_to_token[req, blocks * self.ratio], self.ratio, rounding_mode="floor")

    def extend(self, q, kv, cs, compressor, sink, scale, layer_id, loc, meta: ExtendMeta):
        pool, ratio = self.pool, self.ratio
        win, cmp, state = pool.win[layer_id], pool.cmp[layer_id], pool.state[layer_id]
        win.write(pool.window_loc(loc), kv)
        dev, h, D = q.device, q.shape[1], q.shape[2]
        out = torch.zeros(meta.query_rows(kv.shape[0]), h, D, dtype=torch.float32, device=dev)
        ring = state.shape[1]  # token p's state row is p % ring
        off = 0
        for req, P, E in zip(meta.req, meta.prefix, meta.extend):
            L = P + E
            # open-block rows + new rows -> complete blocks -> compressed entries; the rows of the last
            # ring // ratio blocks -> state
            start = (P // ratio) * ratio
            old = torch.arange(start, P, device=dev) % ring
            rows = torch.cat([state[req, old], cs[off : off + E]], 0)
            b0, b1 = P // ratio, L // ratio
            if b1 > b0:
                blk = rows[: (b1 - b0) * ratio].view(b1 - b0, ratio, -1)
                bidx = torch.arange(b0, b1, device=dev)
                cmp.write(self._cmp_slots(torch.full_like(bidx, req), bidx), compressor.compress(blk, bidx))
            keep = max(P, ratio * (L // ratio - ring // ratio + 1))
            if keep < L:
                state[req, torch.arange(keep, L, device=dev) % ring] = rows[keep - start :]
            off += E
        # attention after every request's compression: a block's entry is written before any query reads it
        for i, s, qpos in meta.query_blocks():
            out[s] = self._attend_extend(q[s], meta.req[i], qpos, win, cmp, sink, scale)
        return out

    def _attend_extend(self, q, req, qpos, win, cmp, sink, scale):
        """Queries at positions `qpos` (host, increasing) of request slot `req`: raw keys max(0, q0-W+1) .. q1-1
        (q0 / q1: the first / one past the last position), then the compressed entries j < (p+1) // ratio in
        chunks."""
        pool, ratio, W, dev = self.pool, self.ratio, self.W, q.device
        q0, q1 = int(qpos[0]), int(qpos[-1]) + 1
        qpos = qpos.to(dev)
        ks = max(0, q0 - W + 1)
        kpos = torch.arange(ks, q1, device=dev)
        acc = OnlineSoftmax(q.shape[0], q.shape[1], q.shape[2], sink, dev)
        raw = win.read(pool.window_loc(self.req_to_token[req, ks:q1]))
        d = qpos[:, None] - kpos[None, :]
        acc.add(_logits(q, raw, (d >= 0) & (d < W), scale), raw)
        nb = q1 // ratio
        step = key_chunk(q.shape[0], read_cost(cmp) + 4 * q.shape[1])
        limit = torch.div(qpos + 1, ratio, rounding_mode="floor")
        for j0 in range(0, nb, step):
            j = torch.arange(j0, min(nb, j0 + step), device=dev)
            keys = cmp.read(self._cmp_slots(torch.full_like(j, req), j))
            acc.add(_logits(q, keys, j[None, :] < limit[:, None], scale), keys)
        return acc.result()

    def decode(self, q, kv, cs, compressor, sink, scale, layer_id, loc, req, pos, width: int):
        """DECODE and TARGET_VERIFY rows (request slot `req`, position `pos`). Every row's state row is
        written first, then every row that ends a block compresses it from the ring (verify rows of one
        request sit in distinct ring rows), then attention. A block completed by a row whose token is later
        rejected is recomputed, at the same slot, by the next verify before any query reads it."""
        pool, ratio, W = self.pool, self.ratio, self.W
        win, cmp, state = pool.win[layer_id], pool.cmp[layer_id], pool.state[layer_id]
        B, dev = q.shape[0], q.device
        valid = loc >= pool.page_size  # padded graph rows write SGLang's padding page / our scratch rows
        win.write(pool.window_loc(loc), kv)  # full slot 0 (padding) -> SWA slot 0 (padding)
        slot = torch.where(valid, req, torch.full_like(req, pool.state_scratch))
        ring = state.shape[1]
        state[slot, pos % ring] = cs
        done = valid & (pos % ratio == ratio - 1)
        blk = torch.div(pos, ratio, rounding_mode="floor")
        rows = ((blk * ratio) % ring)[:, None] + torch.arange(ratio, device=dev)
        entries = compressor.compress(state[slot[:, None], rows], blk)
        cslot = torch.where(done, self._cmp_slots(req, blk), torch.full_like(req, pool.cmp_scratch))
        cmp.write(cslot, entries)
        acc = OnlineSoftmax(B, q.shape[1], q.shape[2], sink, dev)
        wpos = pos[:, None] - (W - 1) + torch.arange(W, device=dev)
        wmask = wpos >= 0
        keys = win.read(pool.window_loc(self.req_to_token[req[:, None], wpos.clamp(min=0)]))
        acc.add(_logits(q, keys, wmask, scale), torch.where(wmask[..., None], keys, 0.0))
        nb = width // ratio
        limit = torch.div(pos + 1, ratio, rounding_mode="floor")
        step = key_chunk(B, read_cost(cmp) + 4 * q.shape[1])
        for j0 in range(0, nb, step):
            j = torch.arange(j0, min(nb, j0 + step), device=dev)
            cmask = j[None, :] < limit[:, None]
            cl = self._cmp_slots(req[:, None], j[None, :].expand(B, -1))
            keys = cmp.read(torch.where(cmask, cl, torch.full_like(cl, pool.cmp_scratch)))
            acc.add(_logits(q, keys, cmask, scale), torch.where(cmask[..., None], keys, 0.0))
        return acc.result()


class TorchMLA:
    """Absorbed MLA over the top-`topk` keys of the lightning indexer (ties to the earlier position)."""

    def __init__(self, pool, req_to_token: torch.Tensor, topk: int):
        self.pool, self.req_to_token, self.topk = pool, req_to_token, topk

    def _step(self, rows: int, heads: int, lat, idx, index_heads: int) -> int:
        """One chunk length for both passes (the second pass recomputes the first pass's scores bit for bit)."""
        return key_chunk(rows, max(read_cost(idx) + 4 * index_heads, read_cost(lat) + 4 * heads))

    def extend(self, q, kc, iq, iw, ik, scale, v_dim, layer_id, loc, meta: ExtendMeta):
        pool = self.pool
        lat, idx = pool.latent[layer_id], pool.index_k[layer_id]
        lat.write(loc, kc)
        idx.write(loc, ik)
        dev = q.device
        out = torch.zeros(meta.query_rows(kc.shape[0]), q.shape[1], v_dim, dtype=torch.float32, device=dev)
        for i, s, qpos in meta.query_blocks():
            n_keys = int(qpos[-1]) + 1  # causal: the keys up to the block's last query
            locs = lambda k0, k1, r=meta.req[i]: self.req_to_token[r, k0:k1]  # noqa: E731
            out[s] = self._attend(
                q[s], iq[s], iw[s], qpos.to(dev), n_keys, locs, None, scale, v_dim, lat, idx
            )
        return out

    def decode(self, q, kc, iq, iw, ik, scale, v_dim, layer_id, loc, req, pos, width: int):
        """DECODE and TARGET_VERIFY rows: the row at position p sees positions 0 .. p of its request."""
        pool = self.pool
        lat, idx = pool.latent[layer_id], pool.index_k[layer_id]
        lat.write(loc, kc)
        idx.write(loc, ik)
        locs = lambda k0, k1: self.req_to_token[req[:, None], torch.arange(k0, k1, device=q.device)[None, :]]  # noqa: E731
        return self._attend(q, iq, iw, pos, width, locs, req, scale, v_dim, lat, idx)

    def _attend(self, q, iq, iw, qpos, n_keys, locs, per_row, scale, v_dim, lat, idx):
        """Rows at positions `qpos` over key positions 0 .. n_keys-1 (causal), read through `locs(k0, k1)`
        ([k] slots shared by the rows, or [R, k] per row when `per_row`)."""
        R, dev = q.shape[0], q.device
        step = self._step(R, q.shape[1], lat, idx, iq.shape[1])
        sel = RunningTopK(R, min(self.topk, max(n_keys, 1)), dev)
        chunks = [(k0, min(n_keys, k0 + step)) for k0 in range(0, n_keys, step)]
        scored = []
        for k0, k1 in chunks:
            kpos = torch.arange(k0, k1, device=dev)
            valid = kpos[None, :] <= qpos[:, None]
            kI = idx.read(locs(k0, k1))
            if per_row is not None:
                kI = torch.where(valid[..., None], kI, 0.0)
            s = _index_scores(iq, iw, kI).masked_fill(~valid, float("-inf"))
            sel.add(s, kpos)
            scored.append((kpos, valid))
        sel.finish(qpos + 1)
        acc = OnlineSoftmax(R, q.shape[1], v_dim, None, dev)
        for (k0, k1), (kpos, valid) in zip(chunks, scored):
            kI = idx.read(locs(k0, k1))
            if per_row is not None:
                kI = torch.where(valid[..., None], kI, 0.0)
            s = _index_scores(iq, iw, kI).masked_fill(~valid, float("-inf"))
            mask = sel.selected(s, kpos[None, :], valid)
            keys = lat.read(locs(k0, k1))
            values = keys[..., :v_dim]
            acc.add(
                _logits(q, keys, mask, scale),
                torch.where(mask[..., None], values, 0.0) if keys.dim() == 3 else values,
            )
        return acc.result()


class TorchPath:
    """The torch implementation of the layer kinds the backend gives it: per-forward metadata (the extend
    batch's host lists, or the decode / verify width and rows per request) and one call per layer."""

    def __init__(self, pool, req_to_token: torch.Tensor, cfg):
        self.hca = TorchHCA(pool, req_to_token, cfg.window_size, cfg.compress_ratio)
        self.mla = TorchMLA(pool, req_to_token, cfg.index_topk)
        self.meta: ExtendMeta | DecodeMeta | None = None

    # ------------------------------------------------------------------ metadata
    def init_extend(self, fb, split=None) -> None:
        self.meta = ExtendMeta(
            req=fb.req_pool_indices.tolist(),
            prefix=list(fb.extend_prefix_lens_cpu),
            extend=list(fb.extend_seq_lens_cpu),
            qidx=None if split is None else split.qidx,
            rows=0 if split is None else split.rows,
        )

    def init_rows(self, rows: TokenRows) -> None:
        self.meta = DecodeMeta(rows.width, rows.per_req)

    def init_graph_host(self, per_req: int, width: int) -> None:
        """The static width (the context length) and the rows per request; the layers read the request slots
        and positions from the runner's static buffers themselves (`_token_rows`)."""
        self.meta = DecodeMeta(width, per_req)

    def init_graph_device(self, rows: TokenRows) -> None:
        pass  # nothing to record: every device op of this path runs inside the layers

    # ------------------------------------------------------------------ layers
    def extend(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        loc = fb.out_cache_loc
        if kind == LAYER_HCA:
            return self.hca.extend(
                q,
                kv,
                inputs.cs.float(),
                inputs.compressor,
                inputs.sink,
                layer.scaling,
                layer.layer_id,
                loc,
                self.meta,
            )
        return self.mla.extend(
            q,
            kv,
            inputs.index_q,
            inputs.index_w,
            inputs.index_k,
            layer.scaling,
            layer.v_head_dim,
            layer.layer_id,
            loc,
            self.meta,
        )

    def rows(self, kind: str, q, kv, inputs: LayerInputs, layer, fb) -> torch.Tensor:
        loc = fb.out_cache_loc
        req, pos = self._token_rows(fb, q.shape[0])
        width = self.meta.width
        if kind == LAYER_HCA:
            return self.hca.decode(
                q,
                kv,
                inputs.cs.float(),
                inputs.compressor,
                inputs.sink,
                layer.scaling,
                layer.layer_id,
                loc,
                req,
                pos,
                width,
            )
        return self.mla.decode(
            q,
            kv,
            inputs.index_q,
            inputs.index_w,
            inputs.index_k,
            layer.scaling,
            layer.v_head_dim,
            layer.layer_id,
            loc,
            req,
            pos,
            width,
        )

    def _token_rows(self, fb, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request slot, position) of each of the T query rows: DECODE has one row per request at
        seq_len - 1; TARGET_VERIFY has T / bs rows per request at seq_len .. seq_len + T / bs - 1 (SGLang's
        seq_lens exclude the verified tokens). Device ops on the batch's tensors, computed in the layer (so a
        CUDA graph records them), no host sync."""
        req, L = fb.req_pool_indices, fb.seq_lens
        if not fb.forward_mode.is_target_verify():
            return req, L - 1
        bs = req.shape[0]
        k = T // max(bs, 1)
        if k * bs != T or k != self.meta.per_req:
            raise ValueError(
                f"ernie55 backend: TARGET_VERIFY with {T} rows for {bs} requests, expected "
                f"{self.meta.per_req} rows each"
            )
        off = torch.arange(k, device=L.device, dtype=L.dtype)
        return req.repeat_interleave(k), (L[:, None] + off[None, :]).reshape(-1)
