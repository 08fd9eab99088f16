"""Block-FP8 Linear (w8a8, 128 x 128 blocks) Triton kernel configs tuned for ERNIE-5.5's Linear shapes, in SGLang's
own file format and names under `triton_<version>/`, and the lookup SGLang's Triton block-FP8 GEMM goes through
(its row in patches.py): serving ERNIE-5.5, a file of this folder wins (the running Triton's folder first, then
the newest other one); otherwise SGLang's `get_w8a8_block_fp8_configs` answers unchanged. The files come from
`benchmarks/tune_fused_moe.py --kernel linear` on the GPU they name (docs/kernels.md).
"""

from __future__ import annotations

import functools
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
BLOCK_KEYS = moe_configs.BLOCK_KEYS
LAUNCH_KEYS = moe_configs.LAUNCH_KEYS
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
    from sglang.kernels.ops.gemm import fp8_kernel

    # a tuned file picks a config per batch size: results then depend on the batch, which deterministic
    # inference forbids (SGLang's fixed default tile is the same for every batch size)
    if not moe_configs._serving_ernie55() or moe_configs._deterministic():
        return original(N, K, block_n, block_k)
    name = file_name(N, K, fp8_kernel.get_device_name(), (block_n, block_k))
    found = moe_configs.load_tuned(
        name, CONFIG_DIR, "block-FP8 GEMM", "benchmarks/tune_fused_moe.py --kernel linear", logger
    )
    return original(N, K, block_n, block_k) if found is None else found


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
    problems, m, entries = moe_configs.read_file(path, _FILE_NAME)
    if entries is None:
        return problems
    found, good = moe_configs.check_entries(entries, int(m.group(5)), HOPPER_KEYS, ("SWAP_AB",), _POW2_KEYS)
    problems += found
    for key, cfg in good.items():
        hopper = cfg.get("SWAP_AB", False) or cfg.get("SPLIT_K", 1) > 1
        if not hopper and set(cfg) & set(HOPPER_KEYS):
            # the plain kernel takes every entry key as a keyword: SPLIT_K 1 / SWAP_AB false would be refused
            problems.append(
                f"M={key}: {sorted(set(cfg) & set(HOPPER_KEYS))} only with SWAP_AB true or SPLIT_K > 1 (SGLang's "
                "SM90 kernel)"
            )
        missing = set(BLOCK_KEYS) - kernel_params(bool(hopper))
        if missing:
            problems.append(f"M={key}: SGLang's kernel takes none of {sorted(missing)}")
    return problems


def shipped_files() -> list[Path]:
    """Every config file of this folder."""
    return moe_configs.shipped_files(CONFIG_DIR)
