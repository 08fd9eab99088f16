#!/usr/bin/env bash
# The GPU suites (`-m gpu`) as one pytest run on a GPU machine whose Python environment is staged in `.gpu/`
# (`setup.sh` prepares it, `env` is sourced: SGLang 0.5.23 and torch for a machine that has neither), with the
# FlashMLA peer unpacked from `.peers/` when present (scripts/stage-peers.sh). Where this package is installed
# with SGLang on a GPU machine, `python3 -m pytest -m gpu -q tests` runs the same suites without either folder.
#   bash scripts/gpu-suite.sh [pytest args...]        (default: all `-m gpu` tests)
# Logs go to $OUT (or ./gpu-out) and a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
bash .gpu/setup.sh > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
source .gpu/env
# The FlashMLA peer (scripts/stage-peers.sh), when carried: kernel comparisons and the fp8 fast path.
if [ -f .peers/flash_mla.tar.xz ]; then
  mkdir -p /tmp/peers && tar -C /tmp/peers -xJf .peers/flash_mla.tar.xz && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(tests)
python3 -m pytest -m "gpu" -q -rs --junitxml="$out/junit.xml" "${args[@]}" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
echo "== summary"; tail -n 3 "$out/pytest.log"
exit "$rc"
