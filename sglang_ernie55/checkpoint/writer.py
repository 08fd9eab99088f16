"""Write a checkpoint directory in the real format (HF layout, docs/checkpoints.md): config.json,
generation_config.json, the tokenizer files, safetensors shards and their index.

Each tensor is stored per its kind (spec.py); FP8 weights are quantized from the bf16-rounded value. Writing
is strict (a bad name raises at once, missing names at the end) and atomic (a temporary sibling directory,
renamed into place at the end, removed on any error).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..configuration import Ernie55Config
from .fp8 import quantize_fp8_block
from .spec import (
    FORMAT_FP8,
    FORMATS,
    FP8_QUANTIZATION_CONFIG,
    KIND_FP8,
    KIND_FP32,
    SCALE_SUFFIX,
    CheckpointError,
    check_tensor_set,
    expected_tensors,
    stored_tensors,
)

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_VOCAB = 512  # the built-in corpus supports about this many BPE tokens

GENERATION_CONFIG = {"do_sample": False, "temperature": 1.0, "top_p": 0.95}


def _log(progress: ProgressFn | None, msg: str) -> None:
    logger.info(msg)
    if progress is not None:
        progress(msg)


def storage_form(name: str, value: torch.Tensor, kind: str, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors stored on disk for one logical tensor (its FP8 scale included)."""
    if kind == KIND_FP32:
        return {name: value.detach().to(torch.float32).cpu().contiguous()}
    bf16 = value.detach().to(torch.bfloat16).contiguous()
    if kind == KIND_FP8 and fmt == FORMAT_FP8:
        q, scale_inv = quantize_fp8_block(bf16)  # on the value's device (fast on GPU)
        return {name: q.cpu(), name + SCALE_SUFFIX: scale_inv.cpu()}
    return {name: bf16.cpu()}


def round_to_storage(
    config: Ernie55Config, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The values a BF16 checkpoint holds, in each tensor's own dtype: bf16-kind tensors rounded to bf16
    and back, fp32 raw parameters unchanged. Load this into a model before writing it, and the model
    read back from the BF16 checkpoint is bitwise the same model."""
    spec = expected_tensors(config)
    out = {}
    for name, t in state_dict.items():
        kind = spec[name].kind if name in spec else KIND_FP32
        out[name] = t if kind == KIND_FP32 else t.detach().to(torch.bfloat16).to(t.dtype)
    return out


def config_json(config: Ernie55Config, fmt: str) -> dict:
    out = config.to_config_json()
    out.pop("quantization_config", None)
    if fmt == FORMAT_FP8:
        out["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return out


def generation_config_json(config: Ernie55Config) -> dict:
    return {**GENERATION_CONFIG, "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}


def parse_size(text: str | int) -> int:
    """'4MB' -> 4_000_000, '5GB' -> 5e9, '512KiB' -> 524288, plain ints are bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class _ShardWriter:
    """Accumulates tensors and flushes a shard once it reaches max_shard_bytes."""

    def __init__(self, directory: Path, max_shard_bytes: int, progress: ProgressFn | None):
        self.dir, self.max, self.progress = directory, max_shard_bytes, progress
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # names per shard, in order
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + nbytes > self.max:
            self.flush()
        self.pending.update(tensors)
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        k = len(self.shards) + 1
        path = self.dir / f"shard-{k:05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())
        _log(
            self.progress, f"wrote shard {k}: {len(self.pending)} tensors, {self.pending_bytes / 1e6:.1f} MB"
        )
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict:
        self.flush()
        n = len(self.shards)
        weight_map = {}
        for k, names in enumerate(self.shards, 1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f"shard-{k:05d}.tmp", self.dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return index


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _prepare_target(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; pass --force to replace a previous checkpoint there")
    if any(out.iterdir()) and not (out / "config.json").is_file():
        raise FileExistsError(
            f"{out} is not empty and holds no config.json: refusing to replace it even with --force"
        )


@contextlib.contextmanager
def staged_checkpoint_dir(out: Path, force: bool):
    """A temporary sibling of `out` to write a checkpoint into, renamed to `out` when the block ends without an
    error and removed when it raises: `out` appears complete or not at all. An existing `out` is replaced only
    with `force` and only if it holds a checkpoint (`_prepare_target`)."""
    _prepare_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a checkpoint is read by servers
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def stored_bytes(config: Ernie55Config, fmt: str) -> int:
    """Bytes of the tensors a checkpoint of `config` in `fmt` stores (`stored_tensors`: FP8 block scales
    included; shard headers, config and tokenizer files left out)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in stored_tensors(config, fmt).values())


def check_free_space(out: Path, need: int) -> None:
    """Refuse, before anything is written, a checkpoint of `need` bytes that does not fit on `out`'s file
    system (an existing checkpoint at `out` stays until the new one is complete, so it does not count)."""
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    margin = 64 << 20  # tokenizer, config, shard headers
    if free < need + margin:
        raise OSError(
            errno.ENOSPC,
            f"writing the checkpoint {out} needs about {(need + margin) / 1e9:.1f} GB and {where} has "
            f"{free / 1e9:.1f} GB free (a checkpoint already there is replaced only after the new one is "
            "complete): remove old checkpoints there or write this one elsewhere",
        )


def write_checkpoint(
    out_dir: str | Path,
    config: Ernie55Config,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    fmt: str,
    *,
    max_shard_bytes: int | str = "4MB",
    force: bool = False,
    tokenizer: bool = True,
    progress: ProgressFn | None = None,
) -> Path:
    """Write a complete checkpoint of format `fmt` (bf16 | fp8) to `out_dir`; returns the path.

    `tensors`: a state dict or a stream of (name, value) pairs with exactly the names and shapes of
    `expected_tensors(config)`. `out_dir` must not exist or be empty; with `force`, an existing
    checkpoint directory (one with a config.json) is replaced, but only after the new one is complete.
    """
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format must be one of {FORMATS}, got {fmt!r}")
    spec = expected_tensors(config)
    if isinstance(tensors, Mapping):  # whole set known: report every problem at once
        check_tensor_set(
            "tensors to write do not match the config",
            {k: tuple(v.shape) for k, v in tensors.items()},
            {k: s.shape for k, s in spec.items()},
        )
        state = tensors
        tensors = ((name, state[name]) for name in spec)
    out = Path(out_dir).absolute()
    check_free_space(out, stored_bytes(config, fmt))
    with staged_checkpoint_dir(out, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config_json(config, fmt), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config_json(config), indent=2) + "\n"
        )
        if tokenizer:
            from .tokenizer import write_tokenizer

            ids = write_tokenizer(tmp, min(config.vocab_size, TOKENIZER_VOCAB))
            if (ids["bos"], ids["eos"]) != (config.bos_token_id, config.eos_token_id):
                raise ValueError(
                    f"config bos/eos ids {(config.bos_token_id, config.eos_token_id)} differ from the "
                    f"tokenizer's {(ids['bos'], ids['eos'])}"
                )
        shards = _ShardWriter(tmp, parse_size(max_shard_bytes), progress)
        seen: set[str] = set()
        for name, value in tensors:
            if name not in spec:
                raise CheckpointError(
                    f"unexpected tensor {name} (not in the config's spec)", unexpected=[name]
                )
            if name in seen:
                raise CheckpointError(f"tensor {name} given twice", unexpected=[name])
            if tuple(value.shape) != spec[name].shape:
                raise CheckpointError(
                    f"mis-shaped tensor {name}: {list(value.shape)}, expected {list(spec[name].shape)}",
                    mismatched=[(name, tuple(value.shape), spec[name].shape)],
                )
            seen.add(name)
            shards.add(storage_form(name, value, spec[name].kind, fmt))
        missing = [k for k in spec if k not in seen]
        if missing:
            raise CheckpointError(f"{len(missing)} tensors missing: " + ", ".join(missing), missing=missing)
        index = shards.finish()
        _log(
            progress,
            f"{len(index['weight_map'])} tensors in {len(shards.shards)} shards, "
            f"{shards.total_bytes / 1e6:.1f} MB ({fmt})",
        )
    return out
