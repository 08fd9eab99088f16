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
