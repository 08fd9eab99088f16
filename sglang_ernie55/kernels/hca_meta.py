"""HCA attention index rows built on the device (torch ops, no host sync, CUDA-graph safe): the
`indices` / `topk_length` of the window scope and the compressed scope for every query token.
"""

from __future__ import annotations

import torch

from ..configuration import HCA_COMPRESS_RATIO, HCA_WINDOW, SERVING_PAGE_SIZE
from ._pool import check


def hca_indices(
    win_pages: torch.Tensor,
    cmp_pages: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    cmp_width: int,
    window: int = HCA_WINDOW,
    ratio: int = HCA_COMPRESS_RATIO,
    page_size: int = SERVING_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For query t of request r at position p (window W, ratio R, page size P, E = P / R entries per page):

        window slots  s = max(0, p - W + 1) .. p  ->  win_pages[r, s // P] * P + s % P      (len min(p + 1, W))
        compressed    j = 0 .. (p + 1) // R - 1   ->  cmp_pages[r, j // E] * E + j % E       (len (p + 1) // R)

    `cmp_pages` are the request's full-pool pages (compressed slot of block j = full_slot(R j) // R); entries
    past a row's length are -1 (FlashMLA's rule), as `tests/kernels/kutil.PagedRequests` builds them.
    win_pages / cmp_pages int32 [B, pages]; q_req, q_pos int [T]; cmp_width: static row width (>= max
    (p + 1) // R, a multiple of 64 for FlashMLA); window / ratio: the layer's (defaults: the full model's).
    Returns (win_idx int32 [T, W], win_len int32 [T], cmp_idx int32 [T, cmp_width], cmp_len int32 [T])."""
    check(win_pages.dim() == 2 and cmp_pages.dim() == 2, "win_pages / cmp_pages: [B, pages]")
    check(q_req.shape == q_pos.shape and q_req.dim() == 1, "q_req, q_pos: [T]")
    check(0 < window <= page_size, f"window: 1 .. {page_size}, got {window}")
    check(0 < ratio <= page_size and page_size % ratio == 0, f"ratio: a divisor of {page_size}, got {ratio}")
    per_page = page_size // ratio
    req = q_req.long()
    p = q_pos.long()
    k = torch.arange(window, device=p.device)
    s = p[:, None] - (window - 1) + k[None, :]  # oldest first
    ok = s >= 0
    sc = s.clamp_min(0)
    pg = win_pages.long()[req[:, None], sc // page_size]
    win = torch.where(ok, pg * page_size + sc % page_size, -1)
    win_len = torch.clamp(p + 1, max=window)
    # valid entries first: shift each row left by its number of invalid (negative-position) entries
    shift = window - win_len
    order = (k[None, :] + shift[:, None]) % window
    win = torch.gather(win, 1, order)
    j = torch.arange(cmp_width, device=p.device)
    cmp_len = (p + 1) // ratio
    okc = j[None, :] < cmp_len[:, None]
    jc = torch.where(okc, j[None, :], 0)
    cp = cmp_pages.long()[req[:, None], jc // per_page]
    cmp = torch.where(okc, cp * per_page + jc % per_page, -1)
    return win.to(torch.int32), win_len.to(torch.int32), cmp.to(torch.int32), cmp_len.to(torch.int32)
