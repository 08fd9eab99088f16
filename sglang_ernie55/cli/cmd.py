"""`sglang-ernie55 cmd`: print the launch command of a hardware cell and its `docker run` line."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "print the `sglang serve` command (and `docker run` line) of a hardware cell"


def configure(parser: argparse.ArgumentParser) -> None:
    """Print the launch command of one hardware cell of configs/cells/ (hardware x precision x strategy).

    Each cell is a declarative file: its node layout, its `sglang serve` flags, its environment and
    who verified it (the vendor's cookbook; this project, with a date). This prints, for every node of
    the cell, the bare command and the matching `docker run` line (GPUs, host network and IPC, the
    Hugging Face cache mounted; the image is the one docker/Dockerfile builds). Nothing is started.

    Multi-node cells (H100 BF16: 2 x 8, GB200 BF16: 2 trays x 4) get `--nnodes`, `--node-rank` and
    `--dist-init-addr` from the arguments: one command per node unless --node-rank picks one;
    without --dist-init-addr the placeholder NODE0_IP:20000 is printed (replace it by node 0's address).

    Unknown or impossible combinations exit 2 with an error that lists every cell that exists.
    `sglang-ernie55 plan` shows the memory budget of the same cell.

    Examples:
      sglang-ernie55 cmd --hardware h100 --precision bf16 --strategy high-throughput
      sglang-ernie55 cmd --hardware b300 --precision fp8 --strategy low-latency --host 0.0.0.0 --port 8080
      sglang-ernie55 cmd --list
    """
    from ..deploy.cells import PRECISIONS, STRATEGIES

    parser.add_argument("--hardware", help="b300 | gb300 | b200 | gb200 | h100 | h200")
    parser.add_argument("--precision", default="fp8", help=f"{' | '.join(PRECISIONS)} (default: fp8)")
    parser.add_argument(
        "--strategy", default="balanced", help=f"{' | '.join(STRATEGIES)} (default: balanced)"
    )
    parser.add_argument(
        "--nodes", type=int, help="check that the cell uses this many nodes (error otherwise)"
    )
    parser.add_argument("--node-rank", type=int, help="print only this node's command (multi-node cells)")
    parser.add_argument("--dist-init-addr", help="HOST:PORT of node 0 for multi-node cells")
    parser.add_argument(
        "--host",
        help="address to bind (SGLang's default: 127.0.0.1). 0.0.0.0 exposes an unauthenticated API "
        "unless you add --api-key",
    )
    parser.add_argument("--port", type=int, help="HTTP port (SGLang's default: 30000)")
    parser.add_argument("--model-path", help="local checkpoint path instead of the Hugging Face repo")
    parser.add_argument(
        "--image", help="container image (default: sglang-ernie55:<version> from docker/Dockerfile)"
    )
    parser.add_argument("--no-docker", action="store_true", help="print only the bare commands")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--list", action="store_true", help="list every cell and exit")


def run(args: argparse.Namespace) -> int:
    from ..deploy.cells import DEFAULT_IMAGE, CellError, cell_table, find_cell

    if args.list:
        print(cell_table())
        return 0
    if not args.hardware:
        print(
            "error: --hardware is required (or --list)\nCells that exist:\n" + cell_table(), file=sys.stderr
        )
        return 2
    try:
        cell = find_cell(args.hardware, args.precision, args.strategy)
        if args.nodes is not None and args.nodes != cell.nodes:
            raise CellError(
                f"cell {cell.name} runs on {cell.nodes} node(s) of {cell.gpus_per_node} {cell.gpu.label} "
                f"({cell.num_gpus} GPUs), not {args.nodes}\nCells that exist:\n{cell_table()}"
            )
        ranks = [args.node_rank] if args.node_rank is not None else list(range(cell.nodes))
        if cell.nodes == 1 and args.node_rank not in (None, 0):
            raise CellError(f"cell {cell.name} is single-node; --node-rank {args.node_rank} makes no sense")
        image = args.image or DEFAULT_IMAGE
        kw = dict(
            dist_init_addr=args.dist_init_addr, host=args.host, port=args.port, model_path=args.model_path
        )
        runnable = cell.runnable()
        recipe = [_entry(cell, r, image, kw) for r in ranks]
        entries = (
            recipe
            if runnable is cell
            else [_entry(runnable, r, image, kw) for r in ranks]
            if runnable
            else []
        )
    except CellError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    warnings = []
    if args.host in ("0.0.0.0", "::"):
        warnings.append(f"--host {args.host} serves an unauthenticated API to the network: add --api-key KEY")
    layout = _layout_lines(cell, runnable)
    if layout and entries:
        warnings.append(
            f"cell {cell.name}: this version refuses the recipe's attention DP / CP; the command printed is the "
            "nearest layout that runs (its # lines say why)"
        )
    if cell.nodes > 1 and entries and not args.dist_init_addr:
        warnings.append("replace NODE0_IP by the address of node 0 (or pass --dist-init-addr HOST:PORT)")
    if args.json:
        print(
            json.dumps(
                {
                    "cell": cell.name,
                    "hardware": cell.hardware,
                    "precision": cell.precision,
                    "strategy": cell.strategy,
                    "nodes": cell.nodes,
                    "gpus_per_node": cell.gpus_per_node,
                    "model": cell.model,
                    "env": cell.env,
                    "vendor_verified": cell.vendor_verified,
                    "project_verified": cell.project_verified,
                    "project_date": cell.project_date or None,
                    "layout_supported": runnable is cell,
                    "commands": entries,
                    "recipe_commands": recipe,
                    "warnings": warnings,
                },
                indent=2,
            )
        )
        return 0 if entries else 1

    verified = f"vendor: {'yes' if cell.vendor_verified else 'no'} ({cell.vendor_note}); " + (
        f"this project: yes, {cell.project_date}" if cell.project_verified else "this project: not yet"
    )
    print(
        f"# {cell.name}: {cell.nodes} x {cell.gpus_per_node} {cell.gpu.label} ({cell.gpu.memory_gb:g} GB), "
        f"{cell.precision.upper()} weights ({cell.model})"
    )
    print(f"# {cell.summary}")
    print(f"# verified by {verified}")
    # the refusal and the recipe go into the printed block itself: a copied or piped command keeps them
    for line in layout:
        print(line)
    for e in recipe if layout else []:
        print(f"#   recipe (refused by this version): {e['command']}")
    for e in entries:
        print()
        if cell.nodes > 1:
            print(f"# node {e['node_rank']} of {cell.nodes}")
        print(e["command"])
        if not args.no_docker:
            print(e["docker"])
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not entries:
        print(
            f"error: no layout of cell {cell.name} runs in this version; no command printed", file=sys.stderr
        )
        return 1
    return 0


def _entry(cell, node_rank: int, image: str, kw: dict) -> dict:
    return {
        "node_rank": node_rank,
        "argv": ["sglang", "serve", *cell.serve_argv(node_rank=node_rank, **kw)],
        "command": cell.shell_command(node_rank=node_rank, **kw),
        "docker": cell.docker_command(image=image, node_rank=node_rank, **kw),
    }


def _layout_lines(cell, runnable) -> list[str]:
    """Comment lines for a cell whose recipe the server refuses when the model is built
    (`Cell.layout_refusal`): why, and what is printed instead (the nearest layout that runs, or nothing).
    Empty when the recipe runs as it is."""
    if runnable is cell:
        return []
    lines = [
        "# NOT YET SUPPORTED: this cell's recipe (the deployment guides') is refused by this version: "
        + str(cell.layout_refusal())
    ]
    if runnable is None:
        lines.append("# No layout of this cell runs in this version, so no command is printed.")
    else:
        dropped = " / ".join(f"--{n}" for n in ("attn-dp-size", "attn-cp-size") if cell.int_flag(n) > 1)
        tp = runnable.int_flag("tp-size", runnable.int_flag("tp", 1))
        lines.append(
            f"# Printed below: the nearest layout that runs, the same flags without {dropped} (attention TP {tp}; "
            "fewer tokens in the KV pool, see `sglang-ernie55 plan`)."
        )
    return lines
