"""`sglang-ernie55 make-tiny`: write a random ERNIE-5.5 checkpoint in the real format."""

from __future__ import annotations

import argparse
import sys

HELP = "write a tiny (or reduced-depth full-width) random checkpoint in the real format"


def configure(parser: argparse.ArgumentParser) -> None:
    """Write a random ERNIE-5.5-Flash checkpoint directory that SGLang and the loader read like the real one.

    The directory holds config.json (model_type ernie5_5_moe; FP8 adds quantization_config
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme":
    "dynamic"}), generation_config.json (greedy: do_sample false, temperature 1.0, top_p 0.95), a
    byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json: BOS <s>=1 added once, EOS </s>=2)
    and safetensors shards with model.safetensors.index.json. Tensor names are those of the real
    checkpoint; FP8 weights are float8_e4m3fn with fp32 <name>_scale_inv per 128x128 block.

    presets:
      tiny        4 layers, hidden 256, every feature (dense + MoE, HCA + MLA-DSA, mHC, ECHO); FP8 shapes
                  have whole and ragged 128-blocks. Weights: the reference model's init_random_(seed),
                  so Ernie55ReferenceModel built with the same seed holds bitwise the same BF16 weights.
      full-width  the real widths (hidden 4096, 64 heads, 512 experts, latent 2048, vocab 103424) with
                  --layers layers (default 4): for GPU benchmarks. Streams tensor by tensor; about
                  6.6 GB per MoE layer in FP8 (13 GB in BF16). --device cuda makes it much faster.

    The directory is written next to --out under a temporary name and renamed into place when
    complete; on error nothing is left. An existing non-empty --out is refused unless --force, and
    --force replaces only a directory that holds a config.json (a previous checkpoint).

    examples:
      sglang-ernie55 make-tiny --out /tmp/ernie55-tiny
      sglang-ernie55 make-tiny --out /tmp/ernie55-tiny-fp8 --dtype fp8 --seed 1
      sglang-ernie55 make-tiny --out /data/ernie55-fw4 --preset full-width --layers 4 --dtype fp8 --device cuda
    """
    parser.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create")
    parser.add_argument(
        "--dtype", choices=("bf16", "fp8"), default="bf16", help="checkpoint format (default bf16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--preset", choices=("tiny", "full-width"), default="tiny", help="geometry (default tiny)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="number of layers (default: tiny 4, full-width 4)",
    )
    parser.add_argument(
        "--init",
        choices=("reference", "spec"),
        default=None,
        help="weights from the reference model's init (tiny default) or streamed per tensor "
        "from the spec (full-width default)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="largest shard, e.g. 4MB, 5GB (default: tiny 4MB, full-width 2GB)",
    )
    parser.add_argument(
        "--device", default="cpu", help="device for --init spec random draws and FP8 quantization"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing checkpoint directory at --out"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.spec import CheckpointError
    from ..checkpoint.tiny import make_checkpoint
    from ..configuration import Ernie55ConfigError

    if args.layers is not None and args.layers < 1:
        print("make-tiny: --layers must be >= 1", file=sys.stderr)
        return 2
    progress = None if args.quiet else (lambda msg: print(f"make-tiny: {msg}", file=sys.stderr))
    try:
        out = make_checkpoint(
            args.out,
            preset=args.preset,
            dtype=args.dtype,
            seed=args.seed,
            layers=args.layers,
            init=args.init,
            max_shard_size=args.max_shard_size,
            device=args.device,
            force=args.force,
            progress=progress,
        )
    except (FileExistsError, CheckpointError, Ernie55ConfigError, ValueError) as e:
        print(f"make-tiny: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
