"""`sglang-ernie55 preflight`: read-only. It reports versions, the entry point, SGLANG_PLUGINS, strict model
imports, GPUs vs the cell (including "no GPU", as on this machine) and a server's /v1/models, and it never
starts a process, downloads anything or sends a generation request."""

from __future__ import annotations

import http.server
import json
import pkgutil
import socket
import subprocess
import threading
from types import SimpleNamespace

import pytest

from sglang_ernie55.cli import preflight as P


def args(**kw):
    base = dict(
        hardware=None,
        precision="fp8",
        strategy="balanced",
        url="http://127.0.0.1:9",
        no_server=True,
        json=False,
    )
    return SimpleNamespace(**(base | kw))


def by_name(checks):
    return {c.name: c for c in checks}


@pytest.fixture
def server():
    """A fake SGLang server that records every request it gets."""
    seen: list[tuple[str, str]] = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(("GET", self.path))
            body = json.dumps({"object": "list", "data": [{"id": "baidu/ERNIE-5.5-Flash-Base"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            seen.append(("POST", self.path))
            self.send_response(500)
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


@pytest.fixture
def no_side_effects(monkeypatch):
    """Fail on any process start or hub download; record every outgoing connection."""
    connects: list = []
    real_connect = socket.socket.connect

    def connect(self, addr):
        connects.append(addr)
        return real_connect(self, addr)

    def forbidden(*a, **k):
        raise AssertionError(f"preflight must not start processes or download: {a[:2]}")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    import huggingface_hub

    for name in ("snapshot_download", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, name, forbidden)
    return connects


def test_versions_and_plugin_on_this_machine():
    c = by_name(P.run_checks(args()))
    assert c["sglang"].status == "ok" and c["sglang"].data["version"] == "0.5.23"
    assert c["torch"].status == "ok"
    assert (
        c["entry point"].status == "ok" and c["entry point"].data["value"] == "sglang_ernie55.plugin:register"
    )
    assert c["architectures"].status == "ok" and c["registry"].status == "ok"


def test_no_gpu_is_reported_cleanly(monkeypatch):
    monkeypatch.setattr(P, "_visible_gpus", lambda: ([], None))
    c = by_name(P.run_checks(args()))
    assert c["gpus"].status == "fail" and "cannot serve the model" in c["gpus"].detail
    assert "sglang-ernie55 demo --cpu" in c["gpus"].detail
    c = by_name(P.run_checks(args(hardware="h200")))
    assert c["gpus"].status == "fail" and "4 H200" in c["gpus"].detail and c["cell"].status == "ok"


def test_gpus_against_the_cell(monkeypatch):
    def gpus(name, n, gb):
        return lambda: ([{"index": i, "name": name, "memory_gb": gb} for i in range(n)], None)

    monkeypatch.setattr(P, "_visible_gpus", gpus("NVIDIA H200", 8, 150.0))
    c = by_name(P.run_checks(args(hardware="h200", precision="fp8")))
    assert (
        c["gpu model"].status == "ok"
        and c["gpu count"].status == "ok"
        and "CUDA_VISIBLE_DEVICES" in c["gpu count"].detail
    )
    monkeypatch.setattr(P, "_visible_gpus", gpus("NVIDIA H200", 2, 150.0))
    assert by_name(P.run_checks(args(hardware="h200")))["gpu count"].status == "fail"
    monkeypatch.setattr(P, "_visible_gpus", gpus("NVIDIA H100 80GB HBM3", 8, 85.0))
    assert by_name(P.run_checks(args(hardware="h200")))["gpu model"].status == "fail"
    monkeypatch.setattr(P, "_visible_gpus", gpus("NVIDIA H100 80GB HBM3", 8, 40.0))  # a MIG slice, say
    assert by_name(P.run_checks(args(hardware="h100")))["gpu memory"].status == "fail"
    assert by_name(P.run_checks(args(hardware="tpu")))["cell"].status == "fail"


def test_sglang_plugins_excluding_ernie55_fails(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert by_name(P.run_checks(args()))["SGLANG_PLUGINS"].status == "fail"
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else,ernie55")
    assert by_name(P.run_checks(args()))["SGLANG_PLUGINS"].status == "ok"


def test_model_import_errors_are_reported(monkeypatch):
    real = pkgutil.iter_modules

    def with_broken(path=None, prefix=""):
        yield from real(path, prefix)
        if path and any(str(p).endswith("models") for p in path):
            yield pkgutil.ModuleInfo(None, "does_not_import", False)

    monkeypatch.setattr(pkgutil, "iter_modules", with_broken)
    c = by_name(P.check_models())
    bad = c["import sglang_ernie55.models.does_not_import"]
    assert bad.status == "fail" and "ModuleNotFoundError" in bad.detail
    assert "registry" not in c  # no registration on top of a broken import


def test_server_models_only_get(server, no_side_effects):
    url, seen = server
    c = by_name(P.run_checks(args(hardware="h200", no_server=False, url=url)))
    assert c["server"].status == "ok" and c["server"].data["models"] == ["baidu/ERNIE-5.5-Flash-Base"]
    assert "served name" not in c
    assert seen == [("GET", "/v1/models")]  # one GET, no generation
    port = int(url.rsplit(":", 1)[1])
    assert {a[1] for a in no_side_effects if isinstance(a, tuple)} == {port}  # nothing else contacted
    c = by_name(P.run_checks(args(hardware="h200", precision="bf16", no_server=False, url=url)))
    assert c["served name"].status == "warn" and "-BF16" in c["served name"].detail


def test_no_server_is_info_not_failure(no_side_effects):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = by_name(P.check_server(f"http://127.0.0.1:{port}", None))
    assert c["server"].status == "info" and "nothing started" in c["server"].detail


def test_cli_json_and_exit_status(cli, monkeypatch):
    monkeypatch.setattr(
        P, "_visible_gpus", lambda: ([{"index": 0, "name": "NVIDIA H200", "memory_gb": 150.8}], None)
    )
    rc, out, _ = cli("preflight", "--json", "--no-server")
    d = json.loads(out)
    assert (
        rc == 0
        and d["ok"] is True
        and {c["name"] for c in d["checks"]} >= {"sglang", "torch", "entry point", "gpus"}
    )
    rc, out, _ = cli("preflight", "--json", "--no-server", "--hardware", "h100")
    assert rc == 1 and json.loads(out)["ok"] is False
    rc, out, _ = cli("preflight", "--help")
    assert rc == 0 and "never starts a server" in " ".join(out.split())


def test_without_sglang_every_check_still_reports(monkeypatch):
    """Seen on a GPU machine without SGLang: the models package itself imports SGLang. Preflight must report
    that as a failed check, keep going, and still check torch and the GPUs."""
    import importlib.metadata as md
    import sys

    real_version = md.version

    def version(name):
        if name == "sglang":
            raise md.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setitem(sys.modules, "sglang_ernie55.models", None)  # import raises ImportError
    monkeypatch.setattr(
        P, "_visible_gpus", lambda: ([{"index": 0, "name": "NVIDIA H200", "memory_gb": 150.8}], None)
    )
    c = by_name(P.run_checks(args(hardware="h200")))
    assert c["sglang"].status == "fail" and "not installed" in c["sglang"].detail
    assert c["torch"].status == "ok"  # the version checks go on after sglang's
    assert c["import sglang_ernie55.models"].status == "fail"
    assert c["gpu model"].status == "ok" and c["gpu count"].status == "fail"  # 1 of the 4 the cell needs


def test_cell_recipe_the_model_refuses_is_a_layout_warning(monkeypatch, dp_with_ep):
    """A cell whose recipe the model refuses when it is built warns in `layout`, naming the layout that runs and
    that `cmd` prints it; a cell whose recipe builds (attention DP at attention TP 1 and 8 included) has no
    `layout` line."""
    monkeypatch.setattr(P, "_visible_gpus", lambda: ([], None))
    c = by_name(P.run_checks(args(hardware="h200", precision="fp8", strategy="high-throughput")))
    assert c["layout"].status == "warn" and "--attn-dp-size 4" in c["layout"].detail
    assert "without --attn-dp-size (attention TP 8)" in c["layout"].detail and "cmd" in c["layout"].detail
    for hardware, strategy in (
        ("h200", "low-latency"),
        ("h200", "high-throughput"),
        ("h100", "high-throughput"),
    ):
        c = by_name(P.run_checks(args(hardware=hardware, precision="bf16", strategy=strategy)))
        assert "layout" not in c, (hardware, strategy)


def test_cell_with_no_layout_that_runs_fails_layout(monkeypatch, no_layout_runs):
    monkeypatch.setattr(P, "_visible_gpus", lambda: ([], None))
    c = by_name(P.run_checks(args(hardware="h100", precision="bf16", strategy="high-throughput")))
    assert c["layout"].status == "fail" and "no layout" in c["layout"].detail


def test_verdict_matches_the_findings(cli, monkeypatch, dp_with_ep):
    """The last stdout line is the verdict and agrees with the exit status; progress goes to stderr."""
    monkeypatch.setattr(P, "_visible_gpus", lambda: ([], None))
    rc, out, err = cli("preflight", "--no-server")
    assert rc == 1 and "cannot serve the model" in out
    assert out.splitlines()[-1] == "preflight: FAILED (gpus)"
    assert "preflight [" in err and "model modules" in err
    monkeypatch.setattr(
        P,
        "_visible_gpus",
        lambda: ([{"index": i, "name": "NVIDIA H200", "memory_gb": 150.8} for i in range(4)], None),
    )
    rc, out, _ = cli("preflight", "--no-server", "--hardware", "h200")
    assert rc == 0 and out.splitlines()[-1] == "preflight: ok"
    monkeypatch.setattr(
        P,
        "_visible_gpus",
        lambda: ([{"index": i, "name": "NVIDIA H200", "memory_gb": 150.8} for i in range(8)], None),
    )
    argv = ("--hardware", "h200", "--precision", "bf16", "--strategy", "high-throughput")
    rc, out, _ = cli("preflight", "--no-server", *argv)
    assert rc == 0 and out.splitlines()[-1] == "preflight: ok"  # attention DP at attention TP 1 builds
    argv = ("--hardware", "h200", "--precision", "fp8", "--strategy", "high-throughput")
    rc, out, _ = cli("preflight", "--no-server", *argv)  # attention DP with EP: refused, --tp 8 --ep 8 runs
    assert rc == 0 and out.splitlines()[-1] == "preflight: ok, with warnings (layout)"
