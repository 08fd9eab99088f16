#!/usr/bin/env bash
# The GPU suites on the lent H200 (see ../shared/gpu/README.md). Here, once per checkout:
#   ../shared/gpu/stage.sh
#   bash scripts/stage-peers.sh          (optional: the FlashMLA peer, carried as .peers)
# then as the device command, carrying [".gpu", ".peers"]:
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
