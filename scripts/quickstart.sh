#!/usr/bin/env bash
# The README's main job: install this package (with sglang==0.5.23 and its torch) when it is missing,
# then run `sglang-ernie55 demo`: a tiny random ERNIE-5.5 checkpoint served by SGLang's real server (GPU:
# no flag but the model path; no GPU: on the CPU), one greedy completion next to the reference model's.
# Works from any directory; arguments go to the demo (`bash scripts/quickstart.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sglang_ernie55, sglang, transformers" 2>/dev/null; then
  echo "[quickstart] installing sglang-ernie55 and sglang==0.5.23 into $(python3 -c 'import sys; print(sys.prefix)') (a few minutes the first time)"
  if ! python3 -m pip install -q -e .; then
    echo "[quickstart] pip could not install into this Python. Use a virtual environment:" >&2
    echo "[quickstart]   python3 -m venv .venv && . .venv/bin/activate && bash scripts/quickstart.sh" >&2
    exit 1
  fi
fi
# `python3 -m` rather than the console script: a --user install may not have put it on PATH.
exec python3 -m sglang_ernie55.cli.main demo "$@"
