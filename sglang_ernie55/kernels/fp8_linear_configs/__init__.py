"""Block-FP8 Linear (w8a8, 128 x 128 blocks) Triton kernel configs tuned for ERNIE-5.5's Linear shapes, in SGLang's
own file format and names under `triton_<version>/`, and the lookup SGLang's Triton block-FP8 GEMM goes through
(its row in patches.py): serving ERNIE-5.5, a file of this folder wins (the running Triton's folder first, then
the newest other one); otherwise SGLang's `get_w8a8_block_fp8_configs` answers unchanged. The files come from
`benchmarks/tune_fused_moe.py --kernel linear` on the GPU they name (docs/kernels.md).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

from .. import moe_configs

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent
# SGLang's file name: N=<output features>,K=<input features>,device_name=<GPU, spaces as _>,dtype=fp8_w8a8,
# block_shape=[n, k]
_FILE_NAME = re.compile(
    r"N=(\d+),K=(\d+),device_name=([^,]+),dtype=fp8_w8a8,block_shape=\[(\d+), (\d+)\]\.json"
)
BLOCK_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
LAUNCH_KEYS = ("num_warps", "num_stages")
# SGLang's SM90 variant (`_w8a8_block_fp8_matmul_hopper`): taken when an entry swaps A and B or splits K
HOPPER_KEYS = ("SPLIT_K", "SWAP_AB")
_POW2_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "SPLIT_K")


def file_name(N: int, K: int, device_name: str, block: tuple[int, int] = (128, 128)) -> str:
    """SGLang's file name for a weight [N, K] on `device_name` (as `get_w8a8_block_fp8_configs` builds it)."""
    return (
        f"N={N},K={K},device_name={device_name.replace(' ', '_')},dtype=fp8_w8a8,"
        f"block_shape=[{block[0]}, {block[1]}].json"
    )


def around_get_w8a8_block_fp8_configs(original, N, K, block_n, block_k):
    """AROUND SGLang's `get_w8a8_block_fp8_configs`: ERNIE-5.5's tuned file when this folder has one of SGLang's
    name for these arguments, else SGLang's answer. Cached per arguments, as SGLang caches its own (every
    block-FP8 GEMM asks)."""
    return _resolve(original, N, K, block_n, block_k)


@functools.cache
def _resolve(original, N, K, block_n, block_k):
    import triton
    from sglang.kernels.ops.gemm import fp8_kernel

    # a tuned file picks a config per batch size: results then depend on the batch, which deterministic
    # inference forbids (SGLang's fixed default tile is the same for every batch size)
    if not moe_configs._serving_ernie55() or moe_configs._deterministic():
        return original(N, K, block_n, block_k)
    name = file_name(N, K, fp8_kernel.get_device_name(), (block_n, block_k))
    path = moe_configs.find(name, triton.__version__, root=CONFIG_DIR)
    if path is None:
        return original(N, K, block_n, block_k)
    if path.parent.name == moe_configs.version_dir(triton.__version__):
        logger.info("ERNIE-5.5: using the block-FP8 GEMM config %s", path)
    else:
        logger.warning(
            "ERNIE-5.5: no block-FP8 GEMM config %s for Triton %s; using the one tuned under %s (%s). Re-tune "
            "with benchmarks/tune_fused_moe.py --kernel linear for the best speed",
            name,
            triton.__version__,
            path.parent.name,
            path,
        )
    return moe_configs.load(path)


def kernel_params(hopper: bool) -> set[str]:
    """The parameters of SGLang's Triton block-FP8 GEMM kernel (`hopper`: its SM90 split-K / swap-AB one)."""
    from sglang.kernels.ops.gemm import fp8_kernel

    k = fp8_kernel._w8a8_block_fp8_matmul_hopper if hopper else fp8_kernel._w8a8_block_fp8_matmul
    return set(k.arg_names)


def check_file(path: Path) -> list[str]:
    """What is wrong with a config file for SGLang's lookup and kernel (empty: nothing): a `triton_<version>`
    folder, SGLang's file-name pattern, integer batch sizes, each entry with the four block keys (tiles powers of
    two >= 16, BLOCK_SIZE_K dividing the block's k), Triton launch options, and SPLIT_K (a power of two) / SWAP_AB
    only where they select SGLang's SM90 kernel, whose parameters they are."""
    path = Path(path)
    problems = []
    if not moe_configs._VERSION_DIR.fullmatch(path.parent.name):
        problems.append(f"folder {path.parent.name!r} is not triton_<version>")
    m = _FILE_NAME.fullmatch(path.name)
    if m is None:
        return problems + [f"{path.name!r} is not SGLang's file-name pattern"]
    block_k = int(m.group(5))
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        return problems + [f"unreadable: {e}"]
    if not isinstance(entries, dict) or not entries:
        return problems + ["not a non-empty object of batch size -> config"]
    for key, cfg in entries.items():
        if not key.isdigit() or int(key) < 1:
            problems.append(f"batch size {key!r} is not a positive integer")
            continue
        if not isinstance(cfg, dict):
            problems.append(f"M={key}: not an object")
            continue
        unknown = set(cfg) - set(BLOCK_KEYS) - set(LAUNCH_KEYS) - set(HOPPER_KEYS)
        missing = [k for k in BLOCK_KEYS if k not in cfg]
        if unknown or missing:
            problems.append(f"M={key}: unknown keys {sorted(unknown)}, missing keys {missing}")
            continue
        if not isinstance(cfg.get("SWAP_AB", False), bool):
            problems.append(f"M={key}: SWAP_AB must be true or false")
            continue
        ints = {k: v for k, v in cfg.items() if k != "SWAP_AB"}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        bad += [k for k in _POW2_KEYS if k in cfg and k not in bad and cfg[k] & (cfg[k] - 1)]
        bad += [k for k in BLOCK_KEYS[:3] if k not in bad and cfg[k] < 16]
        if bad:
            problems.append(
                f"M={key}: {sorted(bad)} must be positive integers (block sizes >= 16, powers of two)"
            )
            continue
        if block_k % cfg["BLOCK_SIZE_K"]:
            problems.append(
                f"M={key}: BLOCK_SIZE_K {cfg['BLOCK_SIZE_K']} does not divide the block's {block_k}"
            )
        hopper = cfg.get("SWAP_AB", False) or cfg.get("SPLIT_K", 1) > 1
        extra = (set(cfg) & set(HOPPER_KEYS)) - ({"SWAP_AB", "SPLIT_K"} if hopper else set())
        if extra:
            # the plain kernel takes every entry key as a keyword: SPLIT_K 1 / SWAP_AB false would be refused
            problems.append(
                f"M={key}: {sorted(extra)} only with SWAP_AB true or SPLIT_K > 1 (SGLang's SM90 kernel)"
            )
        missing_params = set(BLOCK_KEYS) - kernel_params(bool(hopper))
        if missing_params:
            problems.append(f"M={key}: SGLang's kernel takes none of {sorted(missing_params)}")
    return problems


def shipped_files() -> list[Path]:
    """Every config file of this folder."""
    return moe_configs.shipped_files(CONFIG_DIR)
