"""kv_store: every layout, byte-exact against torch_twin.pool_store; round trip within fp8 error. Widths that
are not powers of two (held padded in the kernel, the padding masked) at the geometries a config may take."""

import pytest
import torch

from sglang_ernie55.configuration import SERVING_PAGE_SIZE
from sglang_ernie55.kernels import layout as L
from sglang_ernie55.kernels import torch_twin as R
from sglang_ernie55.kernels.kv_store import kv_load, kv_store
from tests.kernels.kutil import DEV, poison, rel

GEOMS = {
    "hca_fp8": (lambda: L.hca_geometry("fp8"), 512),
    "hca_bf16": (lambda: L.hca_geometry("bf16"), 512),
    "hca_fp8_cmp": (lambda: L.hca_geometry("fp8", page_size=L.HCA_CMP_PER_PAGE), 512),
    "hca_fp8_tiny": (lambda: L.hca_geometry("fp8", dim=128, rope=64), 128),
    "mla_fp8": (lambda: L.mla_geometry("fp8"), 576),
    "mla_bf16": (lambda: L.mla_geometry("bf16"), 576),
    "idx_fp8": (lambda: L.idx_geometry("fp8"), 128),
    "idx_bf16": (lambda: L.idx_geometry("bf16"), 128),
}
# not powers of two: HCA head 96 / rope 32 (nope 64: one fp8 tile), head 112 / rope 32 (bf16 only: nope 80 is
# no whole fp8 tile), head 192 / rope 64 (two fp8 tiles of a 256-wide padded row), a ratio-32 compressed pool
# (8 entries per page); MLA latent 96 + rope 32 (bf16), latent 384 + rope 24 (fp8, a padded bf16 tail);
# indexer keys of 48 (one fp8 scale over a padded row)
ODD = {
    "hca_fp8_d96_r32": (lambda: L.hca_geometry("fp8", 96, 32), 96),
    "hca_bf16_d96_r32": (lambda: L.hca_geometry("bf16", 96, 32), 96),
    "hca_bf16_d112_r32": (lambda: L.hca_geometry("bf16", 112, 32), 112),
    "hca_fp8_d192_r64": (lambda: L.hca_geometry("fp8", 192, 64), 192),
    "hca_fp8_d96_cmp_c32": (lambda: L.hca_geometry("fp8", 96, 32, page_size=SERVING_PAGE_SIZE // 32), 96),
    "mla_bf16_r96_32": (lambda: L.mla_geometry("bf16", 96, 32), 128),
    "mla_fp8_r384_24": (lambda: L.mla_geometry("fp8", 384, 24), 408),
    "idx_fp8_48": (lambda: L.idx_geometry("fp8", 48), 48),
    "idx_bf16_48": (lambda: L.idx_geometry("bf16", 48), 48),
}
GEOMS.update(ODD)


def _check(name, n_tok, pages, dtype=torch.bfloat16):
    make, width = GEOMS[name]
    g = make()
    pages = max(pages, -(-2 * n_tok // g.page_size))
    slots = torch.randperm(pages * g.page_size)[:n_tok].to(torch.int32)
    slots[n_tok // 3] = -1
    # magnitudes over 12 decades, an all-zero token and a token with one huge channel
    x = torch.randn(n_tok, width) * torch.logspace(-6, 6, n_tok)[:, None]
    x[0] = 0
    x[-1, 3] = 3e4
    x[1, :64] = -1e-6  # negative values that round to -0 next to a large one
    x[1, 5] = 400.0
    x = x.to(dtype)
    pool = poison((pages, g.page_bytes), torch.uint8, "cpu")
    ref = pool.clone()
    keep = slots >= 0
    R.pool_store(ref, g, slots[keep], x[keep])
    got = pool.to(DEV)
    kv_store(got, g, slots.to(DEV), x.to(DEV))
    if not torch.equal(got.cpu(), ref):
        diff = (got.cpu() != ref).view(-1).nonzero().flatten()[:8]
        gb, rb = got.cpu().view(-1)[diff].tolist(), ref.view(-1)[diff].tolist()
        tok = []
        for b in diff.tolist():
            page, off = divmod(b, g.page_bytes)
            idx = page * g.page_size + (
                off // g.data_stride
                if off < g.page_size * g.data_stride
                else (off - g.scale_base) // max(g.scale_stride, 1)
            )
            hit = (slots == idx).nonzero().flatten().tolist()
            tok.append((b, idx, hit[:1], x[hit[0]].float().abs().amax().item() if hit else None))
        raise AssertionError(
            f"{name}: {(got.cpu() != ref).sum().item()} bytes differ: got {gb} ref {rb} at {tok}"
        )
    back = R.pool_gather(got.cpu(), g, slots[keep])
    tol = 0.04 if g.layout.is_fp8 else (0.0 if dtype == torch.bfloat16 else 4e-3)  # bf16 rounding of fp32
    assert rel(back, x[keep].float()) <= tol
    # kv_load reads the same values back (exact in bf16), zeros for slot -1
    for out_dtype in (torch.bfloat16, torch.float32):
        loaded = kv_load(got, g, slots.to(DEV), out_dtype).cpu()
        assert loaded.dtype == out_dtype and loaded.shape == (n_tok, width)
        assert torch.equal(loaded[keep].float(), back), name
        assert not loaded[~keep].any(), name
        # into rows of a larger copy: the same rows, the rest untouched
        big = torch.full((n_tok + 3, width), 7.0, dtype=out_dtype, device=DEV)
        assert kv_load(got, g, slots.to(DEV), out_dtype, out=big[2:-1]).data_ptr() == big[2].data_ptr()
        assert torch.equal(big[2:-1].cpu(), loaded) and (big[:2] == 7).all() and (big[-1] == 7).all(), name


@pytest.mark.parametrize("name", list(GEOMS))
def test_kv_store_tiny(name):
    _check(name, 19, 2)


@pytest.mark.parametrize(
    "name", ["mla_fp8", "mla_bf16", "hca_fp8", "hca_bf16", "mla_fp8_r384_24", "hca_bf16_d112_r32"]
)
def test_kv_store_fp32_input_rounds_to_nearest_even(name):
    """fp32 tokens (what the serving layers hand the backend): every bf16 field (the MLA k_rope tail
    included) is rounded to nearest even, as torch's cast; the interpreter's own cast truncates."""
    _check(name, 19, 2, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in GEOMS if n not in ODD])
def test_kv_store_full(name):
    _check(name, 4097, 24)


def test_layout_constants():
    assert L.hca_geometry("fp8").bytes_per_token == 584 and L.hca_geometry("fp8").page_bytes == 149_760
    assert L.hca_geometry("fp8", page_size=2).page_bytes == 1_728
    assert L.mla_geometry("fp8").bytes_per_token == 656
    assert L.idx_geometry("fp8").bytes_per_token == 132
    assert L.hca_geometry("bf16").bytes_per_token == 1024 and L.mla_geometry("bf16").bytes_per_token == 1152


def test_kv_load_of_no_tokens_and_bad_arguments():
    g = L.mla_geometry("fp8")
    pool = torch.zeros(2, g.page_bytes, dtype=torch.uint8, device=DEV)
    assert kv_load(pool, g, torch.zeros(0, dtype=torch.int64, device=DEV)).shape == (0, 576)
    with pytest.raises(ValueError, match="kv_load.dtype"):
        kv_load(pool, g, torch.zeros(1, dtype=torch.int64, device=DEV), torch.float16)
    with pytest.raises(ValueError, match="kv_load.loc"):
        kv_load(pool, g, torch.zeros(1, device=DEV))
    one = torch.zeros(1, dtype=torch.int64, device=DEV)
    bf = torch.bfloat16
    for bad in (torch.zeros(2, 576, dtype=bf), torch.zeros(1, 576), torch.zeros(576, 2, dtype=bf).t()[:1]):
        with pytest.raises(ValueError, match=r"kv_load.out: torch.bfloat16 \[1, 576\] with contiguous rows"):
            kv_load(pool, g, one, out=bad.to(DEV))


def test_kv_store_rejects_bad_shapes():
    g = L.hca_geometry("bf16")
    pool = torch.zeros(1, g.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected \\[N, 512\\]"):
        kv_store(pool, g, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 576))
    with pytest.raises(ValueError, match="uint8 pool"):
        kv_store(pool[:, :100], g, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 512))
