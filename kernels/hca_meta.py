"""HCA attention index rows built on the device (torch ops, no host sync, CUDA-graph safe): the
`indices` / `topk_length` of the window scope and the compressed scope for every query token.

For query t of request r at position p (window W = 128, ratio 128, page size 256):
    window slots   s = max(0, p - W + 1) .. p  ->  win_pages[r, s // 256] * 256 + s % 256   (len min(p + 1, W))
    compressed j   = 0 .. (p + 1) // 128 - 1  ->  cmp_pages[r, j // 2] * 2 + j % 2        (len (p + 1) // 128)
(`cmp_pages` = the request's full-pool pages: compressed slot of block j = full_slot(128 j) // 128.)
Entries past a row's length are -1 (FlashMLA's rule). Matches `tests/kernels/kutil.PagedRequests`.
"""

from __future__ import annotations

import torch

from ._pool import check
from .layout import HCA_CMP_PER_PAGE, HCA_COMPRESS_RATIO, HCA_WINDOW, PAGE_SIZE


def hca_indices(
    win_pages: torch.Tensor, cmp_pages: torch.Tensor, q_req: torch.Tensor, q_pos: torch.Tensor, cmp_width: int,
    window: int = HCA_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """win_pages / cmp_pages int32 [B, pages]; q_req, q_pos int [T]; cmp_width: static row width
    (>= max (p + 1) // 128, a multiple of 64 for FlashMLA). Returns (win_idx int32 [T, window],
    win_len int32 [T], cmp_idx int32 [T, cmp_width], cmp_len int32 [T])."""
    check(win_pages.dim() == 2 and cmp_pages.dim() == 2, "win_pages / cmp_pages: [B, pages]")
    check(q_req.shape == q_pos.shape and q_req.dim() == 1, "q_req, q_pos: [T]")
    req = q_req.long()
    p = q_pos.long()
    k = torch.arange(window, device=p.device)
    s = p[:, None] - (window - 1) + k[None, :]  # oldest first
    ok = s >= 0
    sc = s.clamp_min(0)
    pg = win_pages.long()[req[:, None], sc // PAGE_SIZE]
    win = torch.where(ok, pg * PAGE_SIZE + sc % PAGE_SIZE, -1)
    win_len = torch.clamp(p + 1, max=window)
    # valid entries first: shift each row left by its number of invalid (negative-position) entries
    shift = window - win_len
    order = (k[None, :] + shift[:, None]) % window
    win = torch.gather(win, 1, order)
    j = torch.arange(cmp_width, device=p.device)
    cmp_len = (p + 1) // HCA_COMPRESS_RATIO
    okc = j[None, :] < cmp_len[:, None]
    jc = torch.where(okc, j[None, :], 0)
    cp = cmp_pages.long()[req[:, None], jc // HCA_CMP_PER_PAGE]
    cmp = torch.where(okc, cp * HCA_CMP_PER_PAGE + jc % HCA_CMP_PER_PAGE, -1)
    return win.to(torch.int32), win_len.to(torch.int32), cmp.to(torch.int32), cmp_len.to(torch.int32)
