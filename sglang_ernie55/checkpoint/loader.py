"""Strict reader of ERNIE-5.5 checkpoint directories (the tiny ones of `make-tiny` and the real ones).

The whole tensor set is checked against `stored_tensors(config, fmt)` from the safetensors headers, before
any data is read; tensors come back under their logical names, FP8 weights dequantized. `CheckpointReader`
streams tensor by tensor (what a 280B checkpoint needs); `load_checkpoint` returns a whole state dict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..configuration import MODEL_TYPE, Ernie55Config, Ernie55ConfigError
from .fp8 import dequantize_fp8_block
from .spec import (
    FORMAT_FP8,
    KIND_FP8,
    KIND_FP32,
    SCALE_SUFFIX,
    CheckpointError,
    check_tensor_set,
    checkpoint_format,
    expected_tensors,
    stored_tensors,
)
from .writer import INDEX_FILE, ProgressFn, _log

logger = logging.getLogger(__name__)

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_WIDE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def read_config(path: str | Path) -> Ernie55Config:
    """config.json of a checkpoint directory as an Ernie55Config (errors name the file and field)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json")
    raw = json.loads(f.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{f}: model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
    try:
        return Ernie55Config.from_dict(raw)
    except Ernie55ConfigError as e:
        raise CheckpointError(f"{f}: {e}") from e


class CheckpointReader:
    """One checkpoint directory: config, format, where each tensor lives; `check()` before reading.

    Tensors are found through `model.safetensors.index.json`, else a single `model.safetensors`, else
    every `*.safetensors`."""

    def __init__(self, path: str | Path, progress: ProgressFn | None = None):
        self.path = Path(path)
        self.progress = progress
        self.config = read_config(self.path)
        try:
            self.fmt = checkpoint_format(self.config)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: {e}") from e
        self.spec = expected_tensors(self.config)
        self._handles: dict[str, object] = {}
        self.files = self._shard_files()
        self.location, self.stored = self._scan()

    # ------------------------------------------------------------------ discovery
    def _shard_files(self) -> list[str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            self.index = json.loads(index.read_text())
            weight_map = self.index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: no weight_map")
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (self.path / f).is_file()]
            if absent:
                raise CheckpointError(f"{index} names shard files that do not exist: " + ", ".join(absent))
            return files
        self.index = None
        if (self.path / "model.safetensors").is_file():
            return ["model.safetensors"]
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no {INDEX_FILE} and no *.safetensors files")
        return files

    def _open(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
        return self._handles[file]

    def _scan(self) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """name -> shard and name -> (shape, dtype), from the headers only."""
        location: dict[str, str] = {}
        stored: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        duplicates, misplaced = [], []
        for file in self.files:
            h = self._open(file)
            for name in h.keys():
                if name in location:
                    duplicates.append(f"{name} ({location[name]} and {file})")
                    continue
                sl = h.get_slice(name)
                location[name] = file
                stored[name] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
        if duplicates:
            raise CheckpointError(f"{self.path}: tensors stored twice: " + ", ".join(duplicates))
        if self.index is not None:
            for name, file in self.index["weight_map"].items():
                if name in location and location[name] != file:
                    misplaced.append(f"{name} (index says {file}, found in {location[name]})")
                elif name not in location:
                    misplaced.append(f"{name} (index says {file}, not in that file)")
            unindexed = [n for n in location if n not in self.index["weight_map"]]
            misplaced += [f"{n} (in {location[n]} but not in the index)" for n in unindexed]
            if misplaced:
                raise CheckpointError(f"{self.path}: index and shards disagree: " + ", ".join(misplaced))
        return location, stored

    # ------------------------------------------------------------------ strict check
    def check(self) -> None:
        """Raise CheckpointError naming every tensor that is missing, unexpected, mis-shaped or mis-typed.

        Shapes must match exactly. Dtypes: FP8 weights must be float8_e4m3fn and their scales fp32;
        a tensor the spec stores in bf16 or fp32 may come in any of bf16 / fp16 / fp32 (a real
        checkpoint may keep norms or raw parameters at another float width; values convert exactly
        upward), anything else (an integer, an FP8 tensor where no scale belongs) is mis-typed.
        """
        expected = stored_tensors(self.config, self.fmt)
        found = {}
        for name, (shape, dtype) in self.stored.items():
            want = expected.get(name)
            if want is not None and want[1] in _WIDE_FLOATS and dtype in _WIDE_FLOATS:
                dtype = want[1]
            found[name] = (shape, dtype)
        check_tensor_set(
            f"checkpoint {self.path} ({self.fmt}) does not match its config.json", found, expected
        )

    # ------------------------------------------------------------------ reading
    def _raw(self, name: str) -> torch.Tensor:
        return self._open(self.location[name]).get_tensor(name)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logical tensor `name`, dequantized if FP8; raw fp32 parameters stay fp32 whatever `dtype`."""
        spec = self.spec[name]
        if spec.kind == KIND_FP32:
            return self._raw(name).to(torch.float32)
        if spec.kind == KIND_FP8 and self.fmt == FORMAT_FP8:
            return dequantize_fp8_block(self._raw(name), self._raw(name + SCALE_SUFFIX), dtype)
        return self._raw(name).to(dtype)

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(logical name, tensor) for every tensor, shard by shard; call `check()` first."""
        spec = self.spec
        for k, file in enumerate(self.files, 1):
            names = [n for n, f in self.location.items() if f == file and n in spec]
            for name in names:
                yield name, self.tensor(name, dtype)
            _log(self.progress, f"read {file} ({k}/{len(self.files)}): {len(names)} tensors")


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: ProgressFn | None = None
) -> tuple[Ernie55Config, dict[str, torch.Tensor]]:
    """(config, state_dict) of a checkpoint directory; strict (CheckpointError before any data is read).

    State-dict keys are the logical names of `expected_tensors(config)`, in spec order; FP8 weights
    come back dequantized; raw fp32 parameters are fp32, everything else `dtype`.
    """
    reader = CheckpointReader(path, progress)
    reader.check()
    loaded = dict(reader.iter_tensors(dtype))
    return reader.config, {name: loaded[name] for name in reader.spec}
