"""Fixtures of the CLI tests: a config-only tiny ERNIE-5.5 checkpoint (what SGLang's argument resolution
reads) and a runner for `sglang-ernie55 <subcommand>` in-process."""

from __future__ import annotations

import json

import pytest

from sglang_ernie55.cli.main import main
from sglang_ernie55.configuration import tiny_config


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ernie55-tiny-config")
    (path / "config.json").write_text(json.dumps(tiny_config().to_config_json(), indent=1))
    return str(path)


@pytest.fixture
def cli(capsys):
    """cli("plan", "--table") -> (exit status, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse errors and --help
            rc = int(e.code or 0)
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def _rewrite_cell(monkeypatch, key: tuple[str, str, str], gpus_per_node: int | None = None, **flags):
    """`find_cell(*key)` answers the real cell with `flags` (tp_size=8 -> `tp-size`, ...) set; returns that
    cell."""
    import dataclasses

    from sglang_ernie55.deploy import cells as C

    real = C.find_cell
    cell = real(*key)
    cell = dataclasses.replace(
        cell,
        gpus_per_node=gpus_per_node or cell.gpus_per_node,
        flags={**cell.flags, **{k.replace("_", "-"): v for k, v in flags.items()}},
    )

    def find_cell(hardware, precision, strategy):
        if (hardware, precision, strategy) == key:
            return cell
        return real(hardware, precision, strategy)

    monkeypatch.setattr(C, "find_cell", find_cell)
    return cell


@pytest.fixture
def dp_with_ep(monkeypatch):
    """The cell h200-fp8-high-throughput rewritten to --tp-size 8 --attn-dp-size 4 --ep-size 8 (attention DP with
    EP, refused when the model is built, while --tp 8 --ep 8 alone builds): the cells with a fallback layout.
    Returns the cell."""
    key = ("h200", "fp8", "high-throughput")
    return _rewrite_cell(monkeypatch, key, gpus_per_node=8, tp_size=8, attn_dp_size=4, ep_size=8)


@pytest.fixture
def no_layout_runs(monkeypatch):
    """The cell h100-bf16-high-throughput (--tp-size 16 --attn-dp-size 2) with --ep-size 16: attention DP with EP
    is refused, and without --attn-dp-size attention TP 16 does not divide the 8 HCA output groups, so no layout
    of the cell runs. Returns the cell."""
    return _rewrite_cell(monkeypatch, ("h100", "bf16", "high-throughput"), ep_size=16)
