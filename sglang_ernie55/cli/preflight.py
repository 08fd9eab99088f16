"""`sglang-ernie55 preflight`: read-only checks before launching (versions, plugin, models, GPUs, server)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
import time
from typing import Any

HELP = "read-only checks before launching: versions, plugin entry point, architectures, GPUs vs cell, server"

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
DEFAULT_URL = "http://127.0.0.1:30000"
HTTP_TIMEOUT_S = 3.0


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def configure(parser: argparse.ArgumentParser) -> None:
    """Check, without changing anything, that this machine can serve ERNIE-5.5-Flash with SGLang.

    Checks, in order:
      versions      sglang (must be the pinned version), this plugin, torch, CUDA (torch's build and
                    the driver's, when a GPU is visible)
      entry point   the `sglang.srt.plugins` entry point `ernie55` is installed and not excluded by
                    SGLANG_PLUGINS (SGLang skips plugins missing from that list without an error)
      models        every module of sglang_ernie55.models imports (strictly: SGLang's own registry
                    only logs import errors and the architecture then silently does not exist), and
                    together they provide Ernie5_5_MoeForCausalLM and Ernie5_5MoeMTPModel
      GPUs          model, count and memory of the visible GPUs against the cell chosen with
                    --hardware / --precision / --strategy (a machine without a GPU is reported, not
                    crashed on)
      server        if a server answers at --url, its GET /v1/models and whether it serves the
                    cell's model name

    It never starts a server, downloads weights or sends a generation request: its only network
    access is one GET of <url>/v1/models. Progress lines go to stderr while it runs (the model imports
    take ~10 s). The last line is the verdict: `preflight: ok` (exit status 0) or `preflight: FAILED
    (<checks>)` (exit status 1); a machine without a CUDA GPU fails `gpus`, and a cell whose recipe no
    layout of this version serves fails `layout`.

    Examples:
      sglang-ernie55 preflight
      sglang-ernie55 preflight --hardware h200 --precision fp8 --strategy balanced --json
      sglang-ernie55 preflight --url http://10.0.0.5:30000
    """
    parser.add_argument("--hardware", help="check the GPUs against this cell's hardware (b300 | ... | h200)")
    parser.add_argument("--precision", default="fp8", help="the cell's precision (default: fp8)")
    parser.add_argument("--strategy", default="balanced", help="the cell's strategy (default: balanced)")
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"where a running server would answer (default: {DEFAULT_URL})"
    )
    parser.add_argument("--no-server", action="store_true", help="skip the server check")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# ------------------------------------------------------------------------------------------ checks
def check_versions() -> list[Check]:
    from importlib.metadata import PackageNotFoundError, version

    from .._version import SGLANG_PIN, __version__

    out = []
    try:
        sg = version("sglang")
    except PackageNotFoundError:
        sg = None
    if sg is None:
        out.append(Check("sglang", FAIL, f"sglang is not installed (pip install sglang=={SGLANG_PIN})"))
    elif sg == SGLANG_PIN:
        out.append(Check("sglang", OK, f"sglang {sg} (the pinned version)", {"version": sg}))
    else:
        out.append(
            Check(
                "sglang",
                FAIL,
                f"sglang {sg} installed, this plugin is pinned to {SGLANG_PIN}",
                {"version": sg},
            )
        )
    try:
        dist = version("sglang-ernie55")
    except PackageNotFoundError:
        dist = None
    detail = f"sglang-ernie55 {__version__}" + (
        "" if dist else " (imported from a source tree, not installed)"
    )
    out.append(Check("plugin", OK if dist else WARN, detail, {"version": __version__, "installed": dist}))
    try:
        import torch
    except Exception as e:  # torch missing or broken
        out.append(Check("torch", FAIL, f"torch does not import: {e}"))
        return out
    out.append(Check("torch", OK, f"torch {torch.__version__}", {"version": torch.__version__}))
    cuda = torch.version.cuda
    out.append(
        Check(
            "cuda",
            OK if cuda else WARN,
            f"torch built for CUDA {cuda}" if cuda else "torch built without CUDA (CPU only)",
            {"torch_cuda": cuda},
        )
    )
    return out


def check_entry_point() -> list[Check]:
    from importlib.metadata import entry_points

    from .. import envs

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ernie55"]
    if not eps:
        return [
            Check(
                "entry point", FAIL, "no `sglang.srt.plugins` entry point `ernie55`: reinstall sglang-ernie55"
            )
        ]
    ep = eps[0]
    out = [Check("entry point", OK, f"ernie55 -> {ep.value}", {"value": ep.value})]
    allowed = envs.sglang_plugins_whitelist()
    if allowed is not None and "ernie55" not in allowed:
        out.append(
            Check(
                "SGLANG_PLUGINS",
                FAIL,
                f"SGLANG_PLUGINS={','.join(sorted(allowed))} excludes ernie55: "
                "SGLang would skip the plugin silently; add ernie55",
            )
        )
    else:
        out.append(
            Check("SGLANG_PLUGINS", OK, "unset (all plugins load)" if allowed is None else "includes ernie55")
        )
    return out


def check_models() -> list[Check]:
    import importlib
    import pkgutil

    from ..configuration import ARCHITECTURES

    out = []
    try:
        pkg = importlib.import_module("sglang_ernie55.models")
    except Exception as e:  # the package itself imports SGLang: report, do not crash
        return [Check("import sglang_ernie55.models", FAIL, f"{type(e).__name__}: {e}")]
    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        name = f"sglang_ernie55.models.{info.name}"
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # report, do not stop: every module gets its line
            out.append(Check(f"import {name}", FAIL, f"{type(e).__name__}: {e}"))
            continue
        entry = getattr(mod, "EntryClass", [])
        for cls in entry if isinstance(entry, list) else [entry]:
            found[cls.__name__] = name
    missing = [a for a in ARCHITECTURES if a not in found]
    register = not missing and not any(c.status == FAIL for c in out)
    if missing:
        out.append(
            Check("architectures", FAIL, f"missing {missing} (found {sorted(found)})", {"found": found})
        )
    else:
        out.append(
            Check(
                "architectures", OK, ", ".join(f"{a} ({found[a]})" for a in ARCHITECTURES), {"found": found}
            )
        )
    if register:
        out += check_registry()
    return out


def check_registry() -> list[Check]:
    """Register the plugin in this process (what SGLang's loader does) and look the architectures up in
    SGLang's ModelRegistry. Touches nothing outside this process."""
    from ..configuration import ARCHITECTURES

    try:
        from sglang.srt.models.registry import ModelRegistry

        from .. import plugin

        plugin.register()
    except Exception as e:  # version mismatch, hook target missing, strict import error
        return [Check("registry", FAIL, f"registering the plugin failed: {type(e).__name__}: {e}")]
    bad = {a: getattr(ModelRegistry.models.get(a), "__module__", None) for a in ARCHITECTURES}
    bad = {a: m for a, m in bad.items() if not (m or "").startswith("sglang_ernie55.")}
    if bad:
        return [Check("registry", FAIL, f"SGLang's ModelRegistry maps {bad} to classes not of this plugin")]
    return [Check("registry", OK, "SGLang's ModelRegistry resolves both architectures to this plugin")]


def _driver_cuda_version() -> str | None:
    """The CUDA version the driver supports (NVML, read-only), or None where NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetCudaDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # no NVML, no driver: informational only
        return None


def _visible_gpus() -> tuple[list[dict[str, Any]], str | None]:
    try:
        import torch
    except Exception as e:
        return [], f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return [], None
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 1)})
    return gpus, None


def check_gpus(hardware: str | None, precision: str, strategy: str) -> list[Check]:
    from ..deploy.cells import CellError, find_cell, gpu_from_device_name

    cell = None
    out = []
    if hardware:
        try:
            cell = find_cell(hardware, precision, strategy)
            out.append(
                Check(
                    "cell",
                    OK,
                    f"{cell.name}: {cell.nodes} x {cell.gpus_per_node} {cell.gpu.label}",
                    {"cell": cell.name},
                )
            )
            layout = cell.unimplemented_layout()
            if layout and cell.runnable() is None:
                out.append(Check("layout", FAIL, layout))
            elif layout:  # `cmd` prints the layout that runs, so the cell can still be served
                out.append(Check("layout", WARN, layout + " `sglang-ernie55 cmd` prints that command."))
        except CellError as e:
            out.append(Check("cell", FAIL, str(e).splitlines()[0]))
    gpus, err = _visible_gpus()
    if err:
        return out + [Check("gpus", FAIL, err)]
    if not gpus:
        return out + [
            Check(
                "gpus",
                FAIL,
                "no CUDA GPU visible (torch.cuda.is_available() is False): this machine "
                "cannot serve the model"
                + (f"; {cell.name} needs {cell.gpus_per_node} {cell.gpu.label} per node" if cell else "")
                + " (SGLang's CPU server runs only the tiny demo checkpoint: `sglang-ernie55 demo --cpu`)",
                {"count": 0},
            )
        ]
    names = sorted({g["name"] for g in gpus})
    kinds = {g["name"]: gpu_from_device_name(g["name"]) for g in gpus}
    out.append(Check("gpus", OK, f"{len(gpus)} x {', '.join(names)}", {"gpus": gpus}))
    drv = _driver_cuda_version()
    if drv:
        out.append(Check("cuda driver", INFO, f"the driver supports CUDA {drv}", {"driver_cuda": drv}))
    if cell:
        want = cell.gpu
        wrong = [n for n, k in kinds.items() if k is None or k.key != want.key]
        if wrong:
            out.append(
                Check("gpu model", FAIL, f"the cell wants {want.label}, this host has {', '.join(wrong)}")
            )
        else:
            out.append(Check("gpu model", OK, f"{want.label} as the cell wants"))
        if len(gpus) < cell.gpus_per_node:
            out.append(
                Check(
                    "gpu count",
                    FAIL,
                    f"{len(gpus)} visible, the cell needs {cell.gpus_per_node} per node"
                    + (f" on {cell.nodes} nodes" if cell.nodes > 1 else ""),
                )
            )
        else:
            extra = (
                f" (the cell uses {cell.gpus_per_node}; set CUDA_VISIBLE_DEVICES)"
                if len(gpus) > cell.gpus_per_node
                else ""
            )
            out.append(
                Check(
                    "gpu count",
                    OK,
                    f"{len(gpus)} visible{extra}"
                    + (f"; run one command per node on {cell.nodes} nodes" if cell.nodes > 1 else ""),
                )
            )
        low = [g for g in gpus if g["memory_gb"] < 0.9 * want.memory_gb]
        if low:
            out.append(
                Check(
                    "gpu memory",
                    FAIL,
                    f"{len(low)} GPU(s) below {want.memory_gb:g} GB: {low[0]['memory_gb']} GB",
                )
            )
    return out


def check_server(url: str, cell_model: str | None) -> list[Check]:
    """One GET of <url>/v1/models; nothing else."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/v1/models"
    req = urllib.request.Request(target, method="GET", headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            body = json.loads(resp.read().decode("utf-8") or "{}")
    except urllib.error.HTTPError as e:
        return [Check("server", FAIL, f"{target} answered HTTP {e.code}")]
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        return [Check("server", INFO, f"no server answering at {url} ({reason}); nothing started")]
    except json.JSONDecodeError as e:
        return [Check("server", FAIL, f"{target} did not return JSON: {e}")]
    ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
    out = [Check("server", OK, f"{target}: serving {ids}", {"models": ids})]
    if cell_model and cell_model not in ids:
        out.append(
            Check(
                "served name",
                WARN,
                f"the cell's model {cell_model!r} is not among {ids}: requests must use "
                "the served name in their `model` field",
            )
        )
    return out


def _progress(t0: float, message: str) -> None:
    """A progress line on stderr (stdout stays the report): the model imports take ~10 s."""
    print(f"preflight [{time.monotonic() - t0:4.1f}s] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _still(t0: float, what: str, enabled: bool, every_s: float = 10.0):
    """A "still <what>" line every `every_s` seconds while the block runs (a loaded machine takes a minute)."""
    done = threading.Event()

    def beat():
        while not done.wait(every_s):
            _progress(t0, f"still {what} ...")

    thread = threading.Thread(target=beat, daemon=True) if enabled else None
    if thread:
        thread.start()
    try:
        yield
    finally:
        done.set()


def run_checks(args: argparse.Namespace, progress: bool = False) -> list[Check]:
    t0 = time.monotonic()
    say = (lambda message: _progress(t0, message)) if progress else (lambda message: None)
    say("versions (imports torch and SGLang) ...")
    checks = check_versions()
    say("plugin entry point ...")
    checks += check_entry_point()
    say("model modules (imports SGLang's model code, the slow step) and the registry ...")
    with _still(t0, "importing the model modules", progress):
        checks += check_models()
    say("GPUs ...")
    checks += check_gpus(args.hardware, args.precision, args.strategy)
    if not args.no_server:
        say(f"server at {args.url} ...")
        model = None
        if args.hardware:
            from ..deploy.cells import CellError, find_cell

            try:
                model = find_cell(args.hardware, args.precision, args.strategy).model
            except CellError:
                model = None
        checks += check_server(args.url, model)
    return checks


def verdict(checks: list[Check]) -> str:
    """The last line: FAILED naming the failed checks, else ok (naming the warnings, if any)."""
    failed = [c.name for c in checks if c.status == FAIL]
    warned = [c.name for c in checks if c.status == WARN]
    if failed:
        return f"preflight: FAILED ({', '.join(failed)})"
    return "preflight: ok" + (f", with warnings ({', '.join(warned)})" if warned else "")


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args, progress=True)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
    else:
        for c in checks:
            print(f"[{c.status:4}] {c.name:14} {c.detail}")
        print(verdict(checks))
    return 1 if failed else 0
