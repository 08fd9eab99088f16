"""Random checkpoints in the real format: the `make-tiny` presets and `make_checkpoint`.

`tiny`: `tiny_config()`, weights from the reference model's `init_random_(seed)`, so the in-memory reference
model and the checkpoint hold bitwise the same BF16 weights. `full-width`: the real widths at reduced depth
(`--layers`, default 4) for GPU benchmarks, streamed tensor by tensor from `random_init`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..configuration import LAYER_HCA, LAYER_MLA_DSA, Ernie55Config, tiny_config
from .writer import ProgressFn, config_json, write_checkpoint

PRESETS = ("tiny", "full-width")
INITS = ("reference", "spec")
DEFAULT_SHARD_SIZE = {"tiny": "4MB", "full-width": "2GB"}
DEFAULT_INIT = {"tiny": "reference", "full-width": "spec"}
# written beside a checkpoint made with `reuse`: what made it, so that a later call asking for the same reuses it
RECIPE_FILE = "random_checkpoint.json"


def preset_layer_types(num_layers: int) -> list[str]:
    """Layer kinds for a reduced-depth stack: `mla_dsa` at layer 1 (after the dense layer 0) and where
    i % 7 == 3, `hca` elsewhere; the last layer (ECHO's) stays HCA as in the full model.
    N = 4 gives tiny_config()'s [hca, mla_dsa, hca, hca]."""
    kinds = [LAYER_MLA_DSA if (i == 1 or i % 7 == 3) else LAYER_HCA for i in range(num_layers)]
    if num_layers > 1:
        kinds[-1] = LAYER_HCA
    return kinds


def preset_config(preset: str, layers: int | None = None) -> Ernie55Config:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    depth = {} if layers is None else {"num_hidden_layers": layers, "layer_types": preset_layer_types(layers)}
    if preset == "tiny":
        return tiny_config(**depth)
    if layers is None:
        depth = {"num_hidden_layers": 4, "layer_types": preset_layer_types(4)}
    return Ernie55Config(bos_token_id=1, eos_token_id=2, **depth)


def reference_model(config: Ernie55Config, seed: int):
    """The in-memory reference model whose weights `make_checkpoint(init="reference")` writes."""
    from ..reference.model import build_reference

    return build_reference(config, seed=seed, dtype=torch.bfloat16)


def make_checkpoint(
    out: str | Path,
    *,
    preset: str = "tiny",
    dtype: str = "bf16",
    seed: int = 0,
    layers: int | None = None,
    init: str | None = None,
    max_shard_size: str | int | None = None,
    device: str = "cpu",
    force: bool = False,
    progress: ProgressFn | None = None,
    config: Ernie55Config | None = None,
    reuse: bool = False,
) -> Path:
    """Write a random checkpoint of `preset` in format `dtype` (bf16 | fp8) to `out`; returns the path.

    `config`: any geometry in place of the preset's (e.g. `tiny_config(window_size=64, ...)`); the preset
    then only picks the defaults of `init` and the shard size, and `layers` must be left out.
    `reuse`: a checkpoint at `out` written earlier with `reuse` from the same geometry, format, seed, init and
    device kind is returned as it is (its `random_checkpoint.json` says so); otherwise it is written (replacing
    one there only with `force`) and that file is added. A full-width checkpoint is tens of GB: benchmarks
    that run one after the other then share one."""
    if config is not None and layers is not None:
        raise ValueError("give either `config` or `layers` (the config already fixes the layer stack)")
    config = preset_config(preset, layers) if config is None else config
    init = init or DEFAULT_INIT[preset]
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if init == "reference" and preset != "tiny":
        raise ValueError(
            f"--init reference builds the whole {preset} model in host memory (fp32 first); "
            "use --init spec, which streams tensor by tensor"
        )
    recipe = json.loads(
        json.dumps(
            dict(
                preset=preset,
                dtype=dtype,
                seed=seed,
                init=init,
                device=torch.device(device).type,
                config=config_json(config, dtype),
            )
        )
    )
    target = Path(out).absolute()
    if reuse and (target / "config.json").is_file() and _read_recipe(target) == recipe:
        if progress is not None:
            progress(f"reusing {target}: written earlier from the same geometry, format, seed and init")
        return target
    if init == "reference":
        tensors = reference_model(config, seed).state_dict()
    else:
        from .random_init import iter_random_tensors

        tensors = iter_random_tensors(config, seed, device=device)
    path = write_checkpoint(
        out,
        config,
        tensors,
        dtype,
        max_shard_bytes=max_shard_size or DEFAULT_SHARD_SIZE[preset],
        force=force,
        progress=progress,
    )
    if reuse:
        (path / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    return path


def _read_recipe(path: Path) -> dict | None:
    try:
        return json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None
