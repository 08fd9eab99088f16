#!/usr/bin/env bash
# The serving GPU suites in ONE device command (GPU time is short): the two groups of
# tests/serving/test_server_gpu.py and the full-width baseline (tests/serving/test_full_width_gpu.py) run
# as three pytest processes at once on one H200, each server given a slice of its memory
# (SERVING_MEM_FRACTION). The full-width timings are then taken while the tiny-model servers also run:
# the closing notes say so. Carry [".gpu", ".peers"]. Logs and serving-results.jsonl under $OUT.
#   bash scripts/gpu-serving.sh [--no-full-width]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"; mkdir -p "$out/serving"
bash .gpu/setup.sh > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
source .gpu/env
if [ -f .peers/flash_mla.tar.xz ]; then
  mkdir -p /tmp/peers && tar -C /tmp/peers -xJf .peers/flash_mla.tar.xz && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
export SERVING_LOG_DIR="$out/serving"
run() {  # name, mem fraction, pytest args...
  local name=$1 frac=$2; shift 2
  SERVING_MEM_FRACTION=$frac timeout "${SUITE_TIMEOUT:-560}" python3 -m pytest -q -rs -s "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?" >> "$out/$name.log"
}
pids=()
if [ "${1:-}" != "--no-full-width" ]; then
  run full_width 0.45 tests/serving/test_full_width_gpu.py & pids+=($!)
  sleep 5
fi
run group_bf16 0.12 tests/serving/test_server_gpu.py -k bf16_kv_group & pids+=($!)
run group_fp8 0.12 tests/serving/test_server_gpu.py -k fp8_group & pids+=($!)
wait "${pids[@]}"
echo "== summary"
for f in "$out"/group_bf16.log "$out"/group_fp8.log "$out"/full_width.log; do
  [ -f "$f" ] || continue
  echo "-- $(basename "$f")"; grep -E "^\[|^\| |passed|failed|rc=|Error:" "$f" | tail -25
done
