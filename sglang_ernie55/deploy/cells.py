"""Hardware cells: the declarative launch recipes in `sglang_ernie55/cells/*.toml`, the GPU table they refer
to, and the command lines they turn into. A cell is one (hardware, precision, strategy) triple with its node
layout, the `sglang serve` flags (canonical long names), the environment, and who verified it; the file
schema is in docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import shlex
import tomllib
from typing import Any

from .._version import __version__

STRATEGIES = ("low-latency", "balanced", "high-throughput", "long-context")
PRECISIONS = ("fp8", "bf16")

# precision -> Hugging Face repo of the checkpoint (also the served model name)
MODELS = {"fp8": "baidu/ERNIE-5.5-Flash-Base", "bf16": "baidu/ERNIE-5.5-Flash-Base-BF16"}

# Flags that `cmd` fills from its own arguments; a cell file must not carry them.
RUNTIME_FLAGS = ("model-path", "nnodes", "node-rank", "dist-init-addr", "host", "port")

DEFAULT_PORT = 30000
DEFAULT_DIST_INIT_PORT = 20000
# The image docker/Dockerfile builds (`docker build -t sglang-ernie55:<version> docker/`).
DEFAULT_IMAGE = f"sglang-ernie55:{__version__}"
HF_CACHE_MOUNT = "~/.cache/huggingface:/root/.cache/huggingface"


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model of the cell table. `memory_gb` is the vendor's figure in 10^9 bytes."""

    key: str
    label: str
    memory_gb: float
    arch: str  # "hopper" | "blackwell"
    gpus_per_node: int  # HGX hosts: 8; Grace-Blackwell trays: 4
    device_names: tuple[str, ...]  # substrings of torch.cuda.get_device_name()

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


GPUS: dict[str, Gpu] = {
    g.key: g
    for g in (
        Gpu("b300", "B300", 288, "blackwell", 8, ("B300",)),
        Gpu("gb300", "GB300", 288, "blackwell", 4, ("GB300",)),
        Gpu("b200", "B200", 192, "blackwell", 8, ("B200",)),
        Gpu("gb200", "GB200", 192, "blackwell", 4, ("GB200",)),
        Gpu("h100", "H100", 80, "hopper", 8, ("H100",)),
        Gpu("h200", "H200", 141, "hopper", 8, ("H200",)),
    )
}


def gpu_from_device_name(name: str) -> Gpu | None:
    """The table entry for a CUDA device name ("NVIDIA GB200" -> gb200, not b200)."""
    upper = name.upper()
    for gpu in sorted(GPUS.values(), key=lambda g: -max(len(n) for n in g.device_names)):
        if any(n in upper for n in gpu.device_names):
            return gpu
    return None


class CellError(ValueError):
    """A cell file that breaks the schema, or a request for a cell that does not exist."""


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str  # file stem: <hardware>-<precision>-<strategy>
    hardware: str
    precision: str
    strategy: str
    nodes: int
    gpus_per_node: int
    summary: str
    flags: dict[str, Any]
    env: dict[str, str]
    vendor_verified: bool
    vendor_note: str
    project_verified: bool
    project_date: str

    @property
    def gpu(self) -> Gpu:
        return GPUS[self.hardware]

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def model(self) -> str:
        return MODELS[self.precision]

    def flag(self, name: str, default: Any = None) -> Any:
        return self.flags.get(name, default)

    def int_flag(self, name: str, default: int = 1) -> int:
        return int(self.flags.get(name, default))

    def layout_refusal(self) -> str | None:
        """Why the server refuses this cell's parallel layout when the model is built
        (`args.rules.parallel_layout_refusal` over the cell's flags), else None."""
        from ..args.rules import parallel_layout_refusal

        return parallel_layout_refusal(
            self.int_flag("tp-size", self.int_flag("tp", 1)),
            self.int_flag("attn-dp-size"),
            self.int_flag("attn-cp-size"),
            self.int_flag("ep-size", self.int_flag("ep", 1)),
            bool(self.flag("enable-dp-lm-head", False)),
            str(self.flag("moe-a2a-backend", "none")),
            bool(self.flag("speculative-algorithm")),
        )

    def unimplemented_layout(self) -> str | None:
        """A warning when this cell's recipe (the deployment guides', docs/server-args.md "Deployment facts") uses
        a parallel layout the server refuses when the model is built (`layout_refusal`), else None."""
        why = self.layout_refusal()
        if why is None:
            return None
        runnable = self.runnable()
        dropped = " / ".join(f"--{n}" for n in ("attn-dp-size", "attn-cp-size") if self.int_flag(n) > 1)
        head = f'this recipe (the deployment guides\', docs/server-args.md "Deployment facts") is refused: {why} '
        if runnable is None:
            return head + "This cell has no layout that runs in this version."
        tp = runnable.int_flag("tp-size", runnable.int_flag("tp", 1))
        return head + f"Meanwhile serve with the same command without {dropped} (attention TP {tp})."

    def runnable(self) -> Cell | None:
        """The layout this version serves for this cell: the cell itself when the server builds it, else the same
        flags without attention DP / CP when that layout is legal and builds, else None."""
        if self.layout_refusal() is None:
            return self
        from ..args.rules import DEFAULT_ATTENTION_OUTPUT_GROUPS as groups

        if self.int_flag("attn-dp-size") <= 1 and self.int_flag("attn-cp-size") <= 1:
            return None
        if groups % self.int_flag("tp-size", self.int_flag("tp", 1)):
            return None
        flags = {k: v for k, v in self.flags.items() if k not in ("attn-dp-size", "attn-cp-size")}
        fallback = dataclasses.replace(self, flags=flags)
        return fallback if fallback.layout_refusal() is None else None

    def flag_argv(self) -> list[str]:
        """The cell's own flags as argv (no model path, no node or network flags)."""
        argv: list[str] = []
        for key, value in self.flags.items():
            if value is True:
                argv.append(f"--{key}")
            elif value is False:
                continue
            else:
                argv += [f"--{key}", str(value)]
        return argv

    def serve_argv(
        self,
        *,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        host: str | None = None,
        port: int | None = None,
        model_path: str | None = None,
    ) -> list[str]:
        """Arguments of `sglang serve` for one node of this cell."""
        argv = ["--model-path", model_path or self.model, *self.flag_argv()]
        if self.nodes > 1:
            if not 0 <= node_rank < self.nodes:
                raise CellError(f"--node-rank {node_rank}: cell {self.name} has nodes 0..{self.nodes - 1}")
            argv += ["--nnodes", str(self.nodes), "--node-rank", str(node_rank)]
            argv += ["--dist-init-addr", dist_init_addr or f"NODE0_IP:{DEFAULT_DIST_INIT_PORT}"]
        if host:
            argv += ["--host", host]
        if port is not None:
            argv += ["--port", str(port)]
        return argv

    def shell_command(self, **kw: Any) -> str:
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*env, "sglang", "serve", *map(shlex.quote, self.serve_argv(**kw))])

    def docker_command(self, image: str = DEFAULT_IMAGE, name: str = "ernie55", **kw: Any) -> str:
        parts = [
            "docker",
            "run",
            "-d",
            "-it",
            "--name",
            name,
            "--gpus",
            "all",
            "--network",
            "host",
            "--ipc",
            "host",
            "-v",
            HF_CACHE_MOUNT,
        ]
        for k, v in self.env.items():
            parts += ["-e", f"{k}={v}"]
        parts += [image, "sglang", "serve", *self.serve_argv(**kw)]
        return " ".join(p if p == HF_CACHE_MOUNT else shlex.quote(p) for p in parts)


def _parse(name: str, text: str) -> Cell:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CellError(f"cell {name}: not valid TOML: {e}") from e
    unknown = set(data) - {"cell", "verified", "flags", "env"}
    if unknown:
        raise CellError(f"cell {name}: unknown tables {sorted(unknown)}")
    c, v = data.get("cell", {}), data.get("verified", {})
    flags, env = data.get("flags", {}), data.get("env", {})
    for key in ("hardware", "precision", "strategy", "nodes", "gpus_per_node", "summary"):
        if key not in c:
            raise CellError(f"cell {name}: [cell] lacks `{key}`")
    if c["hardware"] not in GPUS:
        raise CellError(f"cell {name}: hardware {c['hardware']!r} is not one of {sorted(GPUS)}")
    if c["precision"] not in PRECISIONS:
        raise CellError(f"cell {name}: precision {c['precision']!r} is not one of {list(PRECISIONS)}")
    if c["strategy"] not in STRATEGIES:
        raise CellError(f"cell {name}: strategy {c['strategy']!r} is not one of {list(STRATEGIES)}")
    expected = f"{c['hardware']}-{c['precision']}-{c['strategy']}"
    if name != expected:
        raise CellError(f"cell file {name}.toml must be named {expected}.toml after its [cell] table")
    if c["gpus_per_node"] > GPUS[c["hardware"]].gpus_per_node:
        raise CellError(
            f"cell {name}: gpus_per_node {c['gpus_per_node']} > {GPUS[c['hardware']].gpus_per_node}"
        )
    for key in flags:
        if key.startswith("-") or key in RUNTIME_FLAGS:
            raise CellError(
                f"cell {name}: flag `{key}`: write long names without dashes; {RUNTIME_FLAGS} come from `cmd`"
            )
    for key, value in list(flags.items()) + list(env.items()):
        if not isinstance(value, bool | int | str):
            raise CellError(f"cell {name}: `{key}` must be a string, integer or boolean, not {value!r}")
    project, date = bool(v.get("project", False)), str(v.get("project_date", ""))
    if project:
        try:
            datetime.date.fromisoformat(date)
        except ValueError as e:
            raise CellError(
                f"cell {name}: project = true needs project_date as YYYY-MM-DD, got {date!r}"
            ) from e
    return Cell(
        name=name,
        hardware=c["hardware"],
        precision=c["precision"],
        strategy=c["strategy"],
        nodes=int(c["nodes"]),
        gpus_per_node=int(c["gpus_per_node"]),
        summary=str(c["summary"]),
        flags=dict(flags),
        env={k: str(x) for k, x in env.items()},
        vendor_verified=bool(v.get("vendor", False)),
        vendor_note=str(v.get("vendor_note", "")),
        project_verified=project,
        project_date=date,
    )


def cell_files() -> dict[str, str]:
    """{cell name: TOML text} of every shipped cell."""
    root = importlib.resources.files("sglang_ernie55.cells")
    return {
        p.name.removesuffix(".toml"): p.read_text(encoding="utf-8")
        for p in sorted(root.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".toml")
    }


_CACHE: dict[str, Cell] | None = None


def load_cells() -> dict[str, Cell]:
    global _CACHE
    if _CACHE is None:
        cells = [_parse(name, text) for name, text in cell_files().items()]
        order = list(GPUS), list(PRECISIONS), list(STRATEGIES)
        cells.sort(
            key=lambda c: (
                order[0].index(c.hardware),
                order[1].index(c.precision),
                order[2].index(c.strategy),
            )
        )
        _CACHE = {c.name: c for c in cells}
    return _CACHE


def cell_table(cells: dict[str, Cell] | None = None) -> str:
    """One line per cell, for error messages and `cmd --list`."""
    cells = load_cells() if cells is None else cells
    lines = [f"{'hardware':8} {'precision':9} {'strategy':15} {'GPUs':>12}  vendor  project"]
    for c in cells.values():
        layout = f"{c.nodes}x{c.gpus_per_node}" if c.nodes > 1 else str(c.num_gpus)
        proj = c.project_date if c.project_verified else "no"
        lines.append(
            f"{c.hardware:8} {c.precision:9} {c.strategy:15} {layout:>12}  "
            f"{'yes' if c.vendor_verified else 'no':6}  {proj}"
        )
    return "\n".join(lines)


def find_cell(hardware: str, precision: str, strategy: str) -> Cell:
    """The cell for the triple, or CellError naming what is wrong and listing the cells that exist."""
    hardware, precision, strategy = hardware.lower(), precision.lower(), strategy.lower()
    cells = load_cells()
    problems = []
    if hardware not in GPUS:
        problems.append(f"unknown hardware {hardware!r} (known: {', '.join(GPUS)})")
    if precision not in PRECISIONS:
        problems.append(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    if strategy not in STRATEGIES:
        problems.append(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    name = f"{hardware}-{precision}-{strategy}"
    if not problems and name in cells:
        return cells[name]
    if not problems:
        problems.append(f"no cell {name}")
    raise CellError("; ".join(problems) + "\nCells that exist:\n" + cell_table(cells))
