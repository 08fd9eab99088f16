#!/usr/bin/env bash
# Set up and run the main job: install this package (with sglang==0.5.23), make a tiny random
# ERNIE-5.5 checkpoint, and serve it with SGLang to answer one /v1/completions request.
# Without a CUDA GPU it says so and does the part that can run on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sglang_ernie55, sglang" 2>/dev/null; then
  echo "[quickstart] installing sglang-ernie55 and sglang==0.5.23 (a few minutes the first time)"
  python3 -m pip install -q -e .
fi
exec sglang-ernie55 demo "$@"
