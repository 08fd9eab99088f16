"""Shared helpers of the kernel tests: device choice, pools filled through the store kernel, and the
serving-side index lists (window / compressed / paged) built the way the backend builds them."""

from __future__ import annotations

import torch

from sglang_ernie55.configuration import HCA_COMPRESS_RATIO, HCA_WINDOW, SERVING_PAGE_SIZE
from sglang_ernie55.kernels import torch_twin as R
from sglang_ernie55.kernels.kv_store import kv_store
from sglang_ernie55.reference import rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}


def poison(shape, dtype, device=DEV):
    """Garbage (NaN for floats, random bytes for uint8) that a kernel must overwrite or ignore."""
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cos_sin(max_pos: int, rope_dim: int = 64, device=DEV):
    inv = rope.yarn_inv_freq(rope_dim, 160000.0, YARN)
    c, s = rope.cos_sin(torch.arange(max_pos), inv)
    return inv, c.to(device), s.to(device)


class PagedRequests:
    """Requests with given sequence lengths, each with its own shuffled pages in a token pool (page 256)
    and a compressed pool (256 / ratio entries / page, addressed by the token pool's page): the addressing
    SGLang's hybrid pools use (compressed slot of block j = full_slot(ratio j) // ratio). `window` / `ratio`:
    the HCA layer's window_size / compress_ratio (default: the full-size model's 128 / 128)."""

    def __init__(
        self,
        seq_lens,
        page_size=SERVING_PAGE_SIZE,
        extra_pages=3,
        seed=0,
        window=HCA_WINDOW,
        ratio=HCA_COMPRESS_RATIO,
    ):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = list(seq_lens)
        self.page_size = page_size
        self.window, self.ratio = window, ratio
        npg = [max(1, -(-s // page_size)) for s in self.seq_lens]
        total = sum(npg) + extra_pages
        perm = torch.randperm(total, generator=g)
        self.num_pages = total
        self.pages, k = [], 0
        for n in npg:
            self.pages.append(perm[k : k + n].tolist())
            k += n
        maxp = max(npg)
        self.page_table = torch.tensor([p + [0] * (maxp - len(p)) for p in self.pages], dtype=torch.int32)

    def slot(self, r: int, pos: int) -> int:
        return self.pages[r][pos // self.page_size] * self.page_size + pos % self.page_size

    @property
    def cmp_page_size(self) -> int:
        """Entries per page of the compressed pool."""
        return self.page_size // self.ratio

    def cmp_slot(self, r: int, j: int) -> int:
        return self.slot(r, self.ratio * j) // self.ratio

    def token_slots(self, r: int, lo: int, hi: int) -> list[int]:
        return [self.slot(r, p) for p in range(lo, hi)]

    def hca_indices(self, queries, device=DEV):
        """queries: list of (request, position). Window slots of positions max(0, p-W+1)..p and the
        compressed slots of blocks j < (p+1)//ratio, padded with -1 to multiples of 64; lengths."""
        win = [self.token_slots(r, max(0, p - self.window + 1), p + 1) for r, p in queries]
        cmp = [[self.cmp_slot(r, j) for j in range((p + 1) // self.ratio)] for r, p in queries]
        return _pad(win, device), _pad(cmp, device)

    def mla_indices(self, queries, device=DEV):
        """All causal positions 0..p as slots (dense MLA as a sparse list)."""
        return _pad([self.token_slots(r, 0, p + 1) for r, p in queries], device)


def _pad(rows, device, mult=64):
    width = max(mult, -(-max(len(r) for r in rows) // mult) * mult)
    idx = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    # poison the padding beyond the length with valid-looking slots: lengths must be honoured
    ln = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    for i, r in enumerate(rows):
        if len(r) and len(r) < width:
            idx[i, len(r) :] = r[0]
    return idx.to(device), ln.to(device)


def filled_pool(g, num_pages, width, scale=1.0, device=DEV, gen=None):
    """A pool whose every slot holds a fresh random token (written by the store kernel), plus garbage
    in the padding; returns (pool, the bf16 tokens [slots, width])."""
    pool = poison((num_pages, g.page_bytes), torch.uint8, device)
    n = num_pages * g.page_size
    x = (torch.randn(n, width, generator=gen) * scale).to(torch.bfloat16).to(device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    if (
        device == "cpu"
    ):  # the interpreter runs ~10-50 ms per program: use the (byte-identical) reference store
        R.pool_store(pool, g, slots, x)
    else:
        kv_store(pool, g, slots, x)
    return pool, x


def write_config(folder, name: str, entries: dict):
    """A kernel config file `name` holding `entries` (JSON) in `folder` (made if missing); its path."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(entries))
    return folder / name
