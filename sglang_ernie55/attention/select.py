"""Which compute serves each layer kind of the `ernie55` backend (`SGLANG_ERNIE55_ATTN_IMPL`: `auto`, `torch`,
`triton`, `flashmla`; docs/server-args.md), and the implementation objects that run it (`build`: one
`TorchPath` and / or one `KernelPath`). A forced choice that cannot serve a layer kind raises `ValueError`
naming the kind, the reason and the legal values. `flash_mla` is imported lazily (it does not import on CPU).
"""

from __future__ import annotations

import dataclasses
import logging

from ..configuration import LAYER_HCA, LAYER_MLA_DSA

logger = logging.getLogger(__name__)

TORCH, TRITON, FLASHMLA = "torch", "triton", "flashmla"


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: str  # torch | triton | flashmla
    why: str  # one line for the log

    @property
    def kernels(self) -> bool:
        return self.impl != TORCH


def _interpreting() -> bool:
    from ..kernels._pool import interpreting

    return interpreting()


def _geometries(kind: str, pool, layer_id: int):
    if kind == LAYER_HCA:
        return [pool.win[layer_id].geom, pool.cmp[layer_id].geom]
    return [pool.latent[layer_id].geom, pool.index_k[layer_id].geom]


def triton_unfit(kind: str, cfg, pool, layer_id: int) -> str:
    """Why the Triton kernels cannot serve this layer kind ('' when they can). The kernels take every geometry
    `Ernie55Config` accepts (any window <= 256, any compress ratio dividing the 256-token page, any even head /
    rope / latent / indexer widths, bf16 and the fp8 layouts `kernels/layout.fp8_unfit` admits;
    docs/kernels.md "Geometries"), so what is left are the pool and the device."""
    import torch

    if pool.dense:
        return "the pool holds dense fp32 rows (exactness tests only); the kernels read the packed layouts"
    if torch.device(pool.device).type != "cuda" and not _interpreting():
        return "no CUDA device (TRITON_INTERPRET=1 runs the kernels in Triton's CPU interpreter)"
    from ..configuration import SERVING_PAGE_SIZE

    if pool.page_size != SERVING_PAGE_SIZE:
        return f"page size {pool.page_size} (the index-row builders assume {SERVING_PAGE_SIZE})"
    from ..kernels._pool import pool_args

    for g in _geometries(kind, pool, layer_id):
        try:
            pool_args(g)
        except (AssertionError, ValueError) as e:  # a layout the readers do not know: not built by our pools
            return f"layout {g.layout.value} dim {g.dim}: {e}"
    return ""


def flashmla_unfit(kind: str, cfg, pool, layer_id: int, heads: int) -> str:
    """Why FlashMLA's sparse decode cannot serve this layer kind ('' when it can)."""
    import torch

    from ..kernels.layout import KVLayout
    from .kernel_path import FLASHMLA_HEADS

    why = triton_unfit(kind, cfg, pool, layer_id)  # the stores / compression / indexer stay on Triton
    if why:
        return why
    if torch.device(pool.device).type != "cuda":
        return "FlashMLA runs on CUDA only"
    if not pool.fp8:
        return f"KV dtype {pool.kv_dtype} (FlashMLA's sparse decode reads fp8 pools only)"
    g = _geometries(kind, pool, layer_id)[0]
    want = (KVLayout.HCA_FP8, 512, 64) if kind == LAYER_HCA else (KVLayout.MLA_FP8, 512, 64)
    if (g.layout, g.dim, g.rope) != want:
        return (
            f"geometry {g.layout.value} {g.dim}+{g.rope} (FlashMLA reads {want[0].value} {want[1]}+{want[2]})"
        )
    if heads > max(FLASHMLA_HEADS):
        return f"{heads} local heads (FlashMLA takes at most {max(FLASHMLA_HEADS)})"
    try:
        import flash_mla  # noqa: F401
    except Exception as e:  # not installed, or its CUDA library does not load here
        return f"flash_mla does not import ({type(e).__name__}: {str(e)[:120]})"
    return ""


DETERMINISTIC_NOTE = "--enable-deterministic-inference needs batch-invariant attention"


def choose(
    requested: str, kind: str, cfg, pool, layer_id: int, heads: int, deterministic: bool = False
) -> Choice:
    from ..envs import ATTN_IMPLS

    if requested not in ATTN_IMPLS:
        raise ValueError(f"SGLANG_ERNIE55_ATTN_IMPL={requested!r}: legal values are {', '.join(ATTN_IMPLS)}")
    if deterministic:
        return _choose_deterministic(requested, kind, cfg, pool, layer_id)
    if requested == TORCH:
        return Choice(TORCH, "forced")
    if requested in (TRITON, FLASHMLA):
        why = (triton_unfit if requested == TRITON else flashmla_unfit)(
            kind, cfg, pool, layer_id, *(() if requested == TRITON else (heads,))
        )
        if why:
            raise ValueError(
                f"SGLANG_ERNIE55_ATTN_IMPL={requested}: cannot serve the {kind} layers: {why}. "
                f"Legal values: {', '.join(ATTN_IMPLS)} (auto picks what fits)"
            )
        return Choice(requested, "forced")
    # auto
    import torch

    if torch.device(pool.device).type != "cuda":
        return Choice(TORCH, "auto: no CUDA device")
    why_f = flashmla_unfit(kind, cfg, pool, layer_id, heads)
    if not why_f:
        return Choice(FLASHMLA, f"auto: fp8 KV, {heads} local heads")
    why_t = triton_unfit(kind, cfg, pool, layer_id)
    if not why_t:
        return Choice(TRITON, f"auto: FlashMLA does not fit ({why_f})")
    return Choice(TORCH, f"auto: no kernel fits ({why_t})")


# Under --enable-deterministic-inference only the Triton kernels serve on CUDA, in their batch-invariant
# mode (fixed key splits): `auto` skips FlashMLA (its tile scheduler splits keys by the batch's shape) and a
# forced `flashmla` or `torch` (the torch path's reductions follow the batch's widths) is refused; on CPU the
# torch path serves with a warning (nothing there is batch invariant).
def _choose_deterministic(requested: str, kind: str, cfg, pool, layer_id: int) -> Choice:
    """--enable-deterministic-inference: the Triton kernels with fixed key splits, or (CPU only) the torch path."""
    import torch

    on_cuda = torch.device(pool.device).type == "cuda"
    if requested == FLASHMLA or (requested == TORCH and on_cuda):
        why = (
            "FlashMLA's tile scheduler splits each query's keys by the batch's shape"
            if requested == FLASHMLA
            else "the torch path's reductions follow the batch's gather widths"
        )
        raise ValueError(
            f"SGLANG_ERNIE55_ATTN_IMPL={requested}: {DETERMINISTIC_NOTE} and {why}; use auto or triton "
            f"(the Triton kernels with fixed key splits), or drop --enable-deterministic-inference"
        )
    if requested == TORCH or (requested == "auto" and not on_cuda):
        logger.warning(
            "ernie55: --enable-deterministic-inference on the torch path (no CUDA device): %s layer "
            "results may still depend on the batch's composition",
            kind,
        )
        return Choice(TORCH, "deterministic inference without CUDA: the torch path, not batch invariant")
    why = triton_unfit(kind, cfg, pool, layer_id)
    if why:
        raise ValueError(
            f"ernie55: {DETERMINISTIC_NOTE} (the Triton kernels with fixed key splits), but they "
            f"cannot serve the {kind} layers: {why}"
        )
    return Choice(TRITON, "deterministic inference: batch-invariant key splits")


def resolve(
    requested: str, cfg, pool, heads: dict[str, int], deterministic: bool = False
) -> dict[str, Choice]:
    """One Choice per layer kind present in `cfg.layer_types`, logged once per kind."""
    out: dict[str, Choice] = {}
    for kind in (LAYER_HCA, LAYER_MLA_DSA):
        if kind not in cfg.layer_types:
            continue
        lid = cfg.layer_types.index(kind)
        c = choose(requested, kind, cfg, pool, lid, heads[kind], deterministic)
        out[kind] = c
        logger.info("ernie55 attention backend: %s layers run on %s (%s)", kind, c.impl, c.why)
    return out


def build(choice: dict[str, Choice], pool, req_to_token, cfg, split_keys: int | None, query_dtype) -> dict:
    """The implementation object serving each layer kind of `choice`: one `TorchPath` for the kinds on torch,
    one `KernelPath` for the kinds on the kernels (Triton, or FlashMLA for the attention), so that one forward
    builds each path's metadata once for all its kinds."""
    out: dict = {}
    on_torch = [k for k, c in choice.items() if not c.kernels]
    on_kernels = [k for k, c in choice.items() if c.kernels]
    if on_torch:
        from .torch_path import TorchPath

        path = TorchPath(pool, req_to_token, cfg)
        out.update(dict.fromkeys(on_torch, path))
    if on_kernels:
        from .kernel_path import KernelPath

        flashmla = frozenset(k for k in on_kernels if choice[k].impl == FLASHMLA)
        path = KernelPath(pool, req_to_token, cfg, flashmla, split_keys, query_dtype)
        out.update(dict.fromkeys(on_kernels, path))
    return out
