"""Paged KV-cache layouts of ERNIE-5.5-Flash, byte by byte (docs/kv-layout.md: tables and pools).

Every pool is one uint8 tensor ``[num_pages, page_bytes]`` per layer; a slot is ``page * page_size + offset``
(FlashMLA's "index in kvcache"). ``hca_geometry`` / ``mla_geometry`` / ``idx_geometry`` give the byte offsets
at any (dim, rope) width; the full-size values, checked below, are the only ones FlashMLA reads.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from ..checkpoint.spec import FP8_DTYPE
from ..configuration import HCA_COMPRESS_RATIO, SERVING_PAGE_SIZE

HCA_CMP_PER_PAGE = SERVING_PAGE_SIZE // HCA_COMPRESS_RATIO  # 2

# HCA (full size)
HCA_HEAD_DIM = 512
HCA_ROPE_DIM = 64
HCA_NOPE_DIM = HCA_HEAD_DIM - HCA_ROPE_DIM  # 448
HCA_FP8_TILE = 64
# MLA-DSA (full size)
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_FP8_TILE = 128
# Lightning indexer key (full size)
IDX_HEAD_DIM = 128

FP8_AMAX_EPS = 1e-8


class KVLayout(enum.StrEnum):
    """Token encodings (bytes per token at full size).

    HCA_FP8 (584, SGLang's V4): block-split page; data row i at ``i * 576``: 448 e4m3 nope dims, then 64 bf16
    rope dims; scale row i at ``page_size * 576 + i * 8``: one ue8m0 byte per 64-value nope tile (scale
    ``2 ** (byte - 127)``), one pad byte; page bytes padded to a multiple of 576.
    HCA_BF16 (1024): token i at ``i * 1024``: 512 bf16.
    MLA_FP8 (656, FlashMLA's V3.2): interleaved, no page padding; token i at ``i * 656``: 512 e4m3 latent,
    4 fp32 scales (one per 128-value tile), 64 bf16 k_rope.
    MLA_BF16 (1152): token i at ``i * 1152``: [latent 512 | k_rope 64] bf16.
    IDX_FP8 (132): block-split page; key i at ``i * 128`` (128 e4m3), its fp32 scale at ``page_size * 128 + i * 4``.
    IDX_BF16 (256): key i at ``i * 256``: 128 bf16.

    Every fp8 scale is a power of two, ``2**e`` with ``e = ceil(log2(max(amax, 1e-8) / 448))`` per tile and
    values ``e4m3(clamp(x / 2**e, -448, 448))`` (`torch_twin.quant_pow2`).
    """

    HCA_FP8 = "hca_fp8"
    HCA_BF16 = "hca_bf16"
    MLA_FP8 = "mla_fp8"
    MLA_BF16 = "mla_bf16"
    IDX_FP8 = "idx_fp8"
    IDX_BF16 = "idx_bf16"

    @property
    def is_fp8(self) -> bool:
        return self in (KVLayout.HCA_FP8, KVLayout.MLA_FP8, KVLayout.IDX_FP8)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Byte geometry of one layout at one (dim, rope) size.

    ``dim``: values per token the attention reads (HCA 512; MLA 512 latent + 64 rope = 576 with
    ``dim`` = latent width and ``rope`` = 64; indexer 128). ``rope``: bf16 tail kept unquantised.
    A token's data starts at ``page * page_bytes + offset * data_stride``; its scales (fp8
    layouts) at ``page * page_bytes + scale_base + offset * scale_stride``.
    """

    layout: KVLayout
    dim: int
    rope: int
    page_size: int
    bytes_per_token: int
    data_stride: int
    scale_base: int
    scale_stride: int
    page_bytes: int
    tile: int

    @property
    def nope(self) -> int:
        return self.dim - self.rope if self.layout in (KVLayout.HCA_FP8, KVLayout.HCA_BF16) else self.dim

    def alloc(self, num_pages: int, device=None) -> torch.Tensor:
        """A zeroed pool ``[num_pages, page_bytes]`` uint8."""
        return torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)

    def flashmla_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The ``[num_pages, page_size, 1, bytes_per_token]`` view FlashMLA detects the format from."""
        assert self.layout in (KVLayout.HCA_FP8, KVLayout.MLA_FP8), (
            f"FlashMLA reads no {self.layout.value} pool"
        )
        n = self.page_size * self.bytes_per_token
        return pool[:, :n].view(pool.shape[0], self.page_size, 1, self.bytes_per_token).view(FP8_DTYPE)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def hca_geometry(
    kv_dtype: str, dim: int = HCA_HEAD_DIM, rope: int = HCA_ROPE_DIM, page_size: int = SERVING_PAGE_SIZE
):
    """HCA window / compressed pool geometry. ``page_size`` 256 for the window pool, 2 for the compressed."""
    if kv_dtype in ("fp8", "fp8_e4m3"):
        nope = dim - rope
        assert nope % HCA_FP8_TILE == 0, f"HCA fp8 needs (dim - rope) % 64 == 0, got {dim}-{rope}"
        data = nope + 2 * rope
        scale = nope // HCA_FP8_TILE + 1
        return Geometry(
            KVLayout.HCA_FP8,
            dim,
            rope,
            page_size,
            data + scale,
            data,
            page_size * data,
            scale,
            _ceil_to(page_size * (data + scale), data),
            HCA_FP8_TILE,
        )
    assert kv_dtype in ("bf16", "bfloat16"), kv_dtype
    return Geometry(KVLayout.HCA_BF16, dim, rope, page_size, 2 * dim, 2 * dim, 0, 0, page_size * 2 * dim, dim)


def mla_geometry(
    kv_dtype: str, dim: int = MLA_LATENT_DIM, rope: int = MLA_ROPE_DIM, page_size: int = SERVING_PAGE_SIZE
):
    """MLA-DSA latent + rope pool geometry (``dim`` = latent width)."""
    if kv_dtype in ("fp8", "fp8_e4m3"):
        assert dim % MLA_FP8_TILE == 0, f"MLA fp8 needs latent % 128 == 0, got {dim}"
        bpt = dim + 4 * (dim // MLA_FP8_TILE) + 2 * rope
        return Geometry(
            KVLayout.MLA_FP8, dim, rope, page_size, bpt, bpt, dim, bpt, page_size * bpt, MLA_FP8_TILE
        )
    assert kv_dtype in ("bf16", "bfloat16"), kv_dtype
    bpt = 2 * (dim + rope)
    return Geometry(KVLayout.MLA_BF16, dim, rope, page_size, bpt, bpt, 0, 0, page_size * bpt, dim)


def idx_geometry(kv_dtype: str, dim: int = IDX_HEAD_DIM, page_size: int = SERVING_PAGE_SIZE):
    """Lightning-indexer key pool geometry (follows the KV dtype)."""
    if kv_dtype in ("fp8", "fp8_e4m3"):
        return Geometry(
            KVLayout.IDX_FP8, dim, 0, page_size, dim + 4, dim, page_size * dim, 4, page_size * (dim + 4), dim
        )
    assert kv_dtype in ("bf16", "bfloat16"), kv_dtype
    return Geometry(KVLayout.IDX_BF16, dim, 0, page_size, 2 * dim, 2 * dim, 0, 0, page_size * 2 * dim, dim)


def fp8_unfit(config) -> str:
    """Why the fp8_e4m3 KV layouts cannot hold this config's cache: '' when they can, else one sentence naming
    the config.json field(s), the value and the rule. The one statement of what `hca_geometry` /
    `mla_geometry` assert for fp8, judged for the layer kinds the config has (the ECHO draft's rows use its
    last layer's layout, so they add nothing): HCA quantises the non-rope part of a row in 64-value tiles,
    MLA-DSA the latent in 128-value tiles; the rope tail stays bf16 and the indexer key has one scale per
    token, so neither constrains a width. Server-argument resolution calls it (an explicit fp8_e4m3 that does
    not fit is refused, the default is served in bfloat16), so no pool is ever built from an unfit config."""
    kinds = set(config.layer_types)
    if "hca" in kinds:
        D, r = config.head_dim, config.qk_rope_head_dim
        if (D - r) % HCA_FP8_TILE:
            return (
                f"config.json head_dim {D} - qk_rope_head_dim {r} = {D - r} (the HCA non-rope width) must be a "
                f"multiple of {HCA_FP8_TILE} for fp8_e4m3 KV: the HCA fp8 layout quantises it in "
                f"{HCA_FP8_TILE}-value tiles with one ue8m0 scale each"
            )
    if "mla_dsa" in kinds and config.kv_lora_rank % MLA_FP8_TILE:
        return (
            f"config.json kv_lora_rank {config.kv_lora_rank} (the MLA-DSA latent width) must be a multiple of "
            f"{MLA_FP8_TILE} for fp8_e4m3 KV: the MLA fp8 layout quantises it in {MLA_FP8_TILE}-value tiles "
            "with one fp32 scale each"
        )
    return ""


# Full-size constants, checked against the numbers SGLang and FlashMLA use.
HCA_FP8_BYTES_PER_TOKEN = 584
HCA_FP8_SWA_PAGE_BYTES = 149_760  # 256 * 584 = 149,504 -> padded to 260 * 576
HCA_FP8_CMP_PAGE_BYTES = 1_728  # 2 * 584 = 1,168 -> padded to 3 * 576 (864 B / entry)
MLA_FP8_BYTES_PER_TOKEN = 656
IDX_FP8_BYTES_PER_TOKEN = 132

assert hca_geometry("fp8").bytes_per_token == HCA_FP8_BYTES_PER_TOKEN
assert hca_geometry("fp8").page_bytes == HCA_FP8_SWA_PAGE_BYTES
assert hca_geometry("fp8", page_size=HCA_CMP_PER_PAGE).page_bytes == HCA_FP8_CMP_PAGE_BYTES
assert mla_geometry("fp8").bytes_per_token == MLA_FP8_BYTES_PER_TOKEN
assert idx_geometry("fp8").bytes_per_token == IDX_FP8_BYTES_PER_TOKEN

# HCA open-block state: a request-scoped ring of `blocks` compression blocks, row = [values D | scores D] fp32.
# Two blocks under speculative decoding, so a block whose completing tokens are rejected can be recomputed.
HCA_STATE_BLOCKS = 1
HCA_STATE_BLOCKS_SPEC = 2
HCA_STATE_ROWS = HCA_COMPRESS_RATIO  # rows of a one-block ring (ring rows = blocks * HCA_STATE_ROWS)


def hca_state_alloc(
    num_req_slots: int,
    dim: int = HCA_HEAD_DIM,
    device=None,
    blocks: int = HCA_STATE_BLOCKS,
    ratio: int = HCA_COMPRESS_RATIO,
) -> torch.Tensor:
    """``[num_req_slots, blocks * ratio, 2 * dim]`` fp32; row ``p % (blocks * ratio)`` of a request holds
    token p's ``wkv_gate`` output ``[values | scores]`` while p's block is among the request's last ``blocks``
    (the open one, and with two blocks also the one before it). ``ratio``: the layer's compress_ratio."""
    if blocks not in (HCA_STATE_BLOCKS, HCA_STATE_BLOCKS_SPEC):
        raise ValueError(
            f"hca_state_alloc: blocks must be 1 or 2 (2 under speculative decoding), got {blocks}"
        )
    return torch.zeros(num_req_slots, blocks * ratio, 2 * dim, dtype=torch.float32, device=device)
