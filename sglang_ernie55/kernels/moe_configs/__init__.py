"""Fused-MoE Triton kernel configs tuned for ERNIE-5.5's expert shapes, kept in SGLang's own file format and
names under `triton_<version>/`, and the lookup SGLang's Triton MoE runner goes through (its row in
patches.py): serving ERNIE-5.5, a file of this folder wins (the running Triton's folder first, then the newest
other one); otherwise SGLang's `get_moe_configs` answers unchanged. `check_file` states what a file must hold.
The files come from `benchmarks/tune_fused_moe.py` on the GPU they name (docs/kernels.md).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

from ...arch import is_ernie55

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent
_VERSION_DIR = re.compile(r"triton_(\d+(?:_\d+)*)")
# SGLang's file name: E=<experts>,N=<w2's last dim>,device_name=<GPU, spaces as _>[,dtype=..][,block_shape=[n, k]]
_FILE_NAME = re.compile(
    r"E=(\d+),N=(\d+),device_name=([^,]+)(?:,dtype=(\w+))?(?:,block_shape=\[(\d+), (\d+)\])?"
    r"(,per_channel_quant=True)?(_down)?\.json"
)
# One batch size's entry: the kernel's block sizes (constexprs of SGLang's `fused_moe_kernel`), Triton's launch
# options, and the TMA flag SGLang's runner pops before the launch.
BLOCK_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
LAUNCH_KEYS = ("num_warps", "num_stages")
RUNNER_KEYS = ("USE_TMA",)
# tile sizes are tl.arange / tl.dot extents (powers of two, >= 16 for a dot), a warp count is a power of two
_POW2_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps")


def version_dir(triton_version: str) -> str:
    """SGLang's folder name for a Triton version ("3.6.0" -> "triton_3_6_0")."""
    return "triton_" + triton_version.replace(".", "_")


def version_dirs(root: Path | None = None) -> list[Path]:
    """The `triton_<version>` folders of `root` (default: this folder), newest version first."""
    root = CONFIG_DIR if root is None else root
    found = [
        (tuple(int(x) for x in m.group(1).split("_")), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _VERSION_DIR.fullmatch(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def find(file_name: str, triton_version: str, root: Path | None = None) -> Path | None:
    """The file of that name under `root` (default: this folder): in the running Triton's folder, else in the
    newest other version's (a config tuned under another Triton is still a valid launch, and was tuned for
    this geometry)."""
    root = CONFIG_DIR if root is None else root
    exact = root / version_dir(triton_version) / file_name
    if exact.is_file():
        return exact
    for folder in version_dirs(root):
        if (folder / file_name).is_file():
            return folder / file_name
    return None


def load(path: Path) -> dict[int, dict[str, Any]]:
    """batch size -> config, as SGLang's `get_moe_configs` returns a file."""
    with open(path) as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def _serving_ernie55() -> bool:
    from sglang.srt import runtime_context

    try:
        return is_ernie55(runtime_context.process_model_config().hf_config)
    except ValueError:  # no server configuration published in this process: no served model to ask about
        return False


def _deterministic() -> bool:
    # the flag SGLang's own lookup reads (it then serves its fixed, batch-invariant default config)
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc

    return bool(fmc.get_exec().deterministic.enable_deterministic_inference)


def around_get_moe_configs(
    original, E, N, dtype, block_n=0, block_k=0, per_channel_quant=False, down_moe=False
):
    """AROUND SGLang's `get_moe_configs`: ERNIE-5.5's tuned file when this folder has one of SGLang's name for
    these arguments, else SGLang's answer. Cached per arguments, as SGLang caches its own (the runner asks at
    every forward)."""
    return _resolve(original, E, N, dtype, block_n, block_k, per_channel_quant, down_moe)


@functools.cache
def _resolve(original, E, N, dtype, block_n, block_k, per_channel_quant, down_moe):
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as fmc

    def theirs():
        return original(E, N, dtype, block_n, block_k, per_channel_quant=per_channel_quant, down_moe=down_moe)

    if not _serving_ernie55() or _deterministic():
        return theirs()
    name = fmc.get_config_file_name(E, N, dtype, [block_n, block_k], per_channel_quant, down_moe=down_moe)
    found = load_tuned(name, CONFIG_DIR, "MoE kernel", "benchmarks/tune_fused_moe.py", logger)
    return theirs() if found is None else found


def load_tuned(name: str, root: Path, what: str, tuner: str, log: logging.Logger) -> dict | None:
    """The file `name` under `root` (`find`), loaded as SGLang loads one, saying which one is used (with a
    warning when it was tuned under another Triton); None without one."""
    import triton

    path = find(name, triton.__version__, root)
    if path is None:
        return None
    if path.parent.name == version_dir(triton.__version__):
        log.info("ERNIE-5.5: using the %s config %s", what, path)
    else:
        log.warning(
            "ERNIE-5.5: no %s config %s for Triton %s; using the one tuned under %s (%s). Re-tune with %s for "
            "the best speed",
            what,
            name,
            triton.__version__,
            path.parent.name,
            path,
            tuner,
        )
    return load(path)


def kernel_params() -> set[str]:
    """The parameters of SGLang's Triton `fused_moe_kernel` (a config's block keys must be among them)."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import fused_moe_kernel

    return set(fused_moe_kernel.arg_names)


def read_file(path: Path, pattern: re.Pattern) -> tuple[list[str], re.Match | None, dict | None]:
    """A config file's folder and name problems, its name's match of `pattern` and its entries (None where the
    file cannot be checked further: another name, unreadable, not a non-empty object)."""
    path = Path(path)
    problems = []
    if not _VERSION_DIR.fullmatch(path.parent.name):
        problems.append(f"folder {path.parent.name!r} is not triton_<version>")
    m = pattern.fullmatch(path.name)
    if m is None:
        return problems + [f"{path.name!r} is not SGLang's file-name pattern"], None, None
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        return problems + [f"unreadable: {e}"], m, None
    if not isinstance(entries, dict) or not entries:
        return problems + ["not a non-empty object of batch size -> config"], m, None
    return problems, m, entries


def check_entries(
    entries: dict,
    block_k: int,
    extra_keys: tuple[str, ...],
    flag_keys: tuple[str, ...],
    pow2_keys: tuple[str, ...],
) -> tuple[list[str], dict]:
    """Each batch size's entry: a positive integer key; the four block keys, Triton's launch options and
    `extra_keys` only; `flag_keys` true or false, every other value a positive integer, `pow2_keys` powers of two,
    tiles >= 16, BLOCK_SIZE_K dividing the quantisation block's k (`block_k`; 0: none). Returns the problems and
    the entries that passed."""
    problems, good = [], {}
    for key, cfg in entries.items():
        if not key.isdigit() or int(key) < 1:
            problems.append(f"batch size {key!r} is not a positive integer")
            continue
        if not isinstance(cfg, dict):
            problems.append(f"M={key}: not an object")
            continue
        unknown = set(cfg) - set(BLOCK_KEYS) - set(LAUNCH_KEYS) - set(extra_keys)
        missing = [k for k in BLOCK_KEYS if k not in cfg]
        if unknown or missing:
            problems.append(f"M={key}: unknown keys {sorted(unknown)}, missing keys {missing}")
            continue
        flags = [k for k in flag_keys if k in cfg and not isinstance(cfg[k], bool)]
        if flags:
            problems.append(f"M={key}: {', '.join(flags)} must be true or false")
            continue
        ints = {k: v for k, v in cfg.items() if k not in flag_keys}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        bad += [k for k in pow2_keys if k in cfg and k not in bad and cfg[k] & (cfg[k] - 1)]
        bad += [k for k in BLOCK_KEYS[:3] if k not in bad and cfg[k] < 16]
        if bad:
            problems.append(
                f"M={key}: {sorted(bad)} must be positive integers (block sizes >= 16, powers of two)"
            )
        elif block_k and block_k % cfg["BLOCK_SIZE_K"]:
            problems.append(
                f"M={key}: BLOCK_SIZE_K {cfg['BLOCK_SIZE_K']} does not divide the block's {block_k}"
            )
        else:
            good[key] = cfg
    return problems, good


def check_file(path: Path) -> list[str]:
    """What is wrong with a config file for SGLang's lookup and kernel (empty: nothing): a `triton_<version>`
    folder, SGLang's file-name pattern, integer batch sizes, each entry with the four block keys (tiles powers of
    two >= 16, BLOCK_SIZE_K dividing the quantisation block's k) and otherwise only Triton launch options and
    SGLang's `USE_TMA` flag."""
    problems, m, entries = read_file(path, _FILE_NAME)
    if entries is None:
        return problems
    if not set(BLOCK_KEYS) <= kernel_params():
        problems.append(
            f"SGLang's fused_moe_kernel takes none of {sorted(set(BLOCK_KEYS) - kernel_params())}"
        )
    block_k = int(m.group(6)) if m.group(6) else 0
    return problems + check_entries(entries, block_k, RUNNER_KEYS, RUNNER_KEYS, _POW2_KEYS)[0]


def shipped_files(root: Path | None = None) -> list[Path]:
    """Every config file of `root` (default: this folder)."""
    return sorted(p for folder in version_dirs(root) for p in folder.glob("*.json"))
