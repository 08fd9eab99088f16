#!/usr/bin/env bash
# The GPU suites (`-m gpu`) as one pytest run on a GPU machine whose Python environment is staged in `.gpu/`
# (`setup.sh` prepares it, `env` is sourced: SGLang 0.5.23 and torch for a machine that has neither), with the
# FlashMLA and Mooncake peers unpacked from `.peers/` when present (scripts/stage-peers.sh,
# scripts/stage-mooncake.sh; the PD run carries the slimmer runtime `.gpu-pd/` instead: GPU_DIR=.gpu-pd). Where
# this package is installed with SGLang on a GPU machine, `python3 -m pytest -m gpu -q tests` runs the same
# suites without any of these folders.
#   [GPU_DIR=.gpu-pd] bash scripts/gpu-suite.sh [pytest args...]        (default: all `-m gpu` tests)
# Logs go to $OUT (or ./gpu-out) and a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out"
gpu_dir="${GPU_DIR:-.gpu}"
bash "$gpu_dir/setup.sh" > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
source "$gpu_dir/env"
# The FlashMLA peer (scripts/stage-peers.sh), when carried: kernel comparisons and the fp8 fast path.
if [ -f .peers/flash_mla.tar.xz ]; then
  mkdir -p /tmp/peers && tar -C /tmp/peers -xJf .peers/flash_mla.tar.xz && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
# Mooncake's transfer engine (scripts/stage-mooncake.sh), when carried: the PD tests. Its system libraries go
# last on the search path, so the machine's own copies win.
if [ -f .peers/mooncake.tar.xz ]; then
  mkdir -p /tmp/mooncake && tar -C /tmp/mooncake -xJf .peers/mooncake.tar.xz
  # first on the path: a non-CUDA Mooncake installed in the runtime must not shadow the staged CUDA build
  export PYTHONPATH="/tmp/mooncake${PYTHONPATH:+:$PYTHONPATH}" LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/tmp/mooncake/syslib"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(tests)
python3 -m pytest -m "gpu" -q -rs --junitxml="$out/junit.xml" "${args[@]}" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
echo "== summary"; tail -n 3 "$out/pytest.log"
exit "$rc"
