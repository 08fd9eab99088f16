#!/usr/bin/env bash
# The project's test command (README, CI). On a machine without a CUDA GPU the GPU suites skip with a
# reason; on the lent H200 run `bash scripts/gpu-suite.sh` instead (it selects `-m gpu`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m pytest -q tests "$@"
