#!/usr/bin/env bash
# Every GPU correctness suite in ONE command (for a GPU machine held for a short time), as parallel pytest
# processes on the one GPU, each server given a slice of its memory (SERVING_MEM_FRACTION of what is free
# when it starts):
#   group_bf16 / group_fp8   tests/serving/test_server_gpu.py (real servers vs the reference)
#   kernel_path              tests/serving/test_kernel_path_gpu.py (the backend's kernels vs its twin, full width)
#   echo                     tests/echo/test_echo_gpu.py (ECHO through EAGLE, steps 1-3, CUDA graphs)
#   kernels                  tests/kernels (every kernel vs the reference)
#   deterministic            tests/serving/test_deterministic_gpu.py (--enable-deterministic-inference: eager /
#                            graphs / prefix hits / ECHO steps 1-3 bit-identical); det_plain / det_echo: its
#                            no-ECHO and ECHO halves as two processes (det_echo starts its own baseline server)
#   draft_graph              tests/echo/test_draft_graph_gpu.py (the ECHO draft extend as a real CUDA graph)
#   hicache                  tests/serving/test_hicache_gpu.py (a prefix loaded back from HiCache's host pools =
#                            the device hit, SGLang's kernel / direct transfers, bf16 / fp8 KV, ECHO)
# Narrower selections: GROUP_BF16_K / GROUP_FP8_K (pytest -k of the two serving groups), ECHO_GPU_CASES (echo).
#   layer_impl               tests/serving/test_layer_impl_gpu.py (the layers' mHC / routing / norm / RoPE
#                            kernels vs torch, tiny + real widths, a captured decode graph with its timings)
#   full_width               tests/serving/test_full_width_gpu.py (only with --full-width: its timings
#                            would be taken beside the others; run it alone for numbers)
# Needs the staged `.gpu/` (and optionally `.peers/`) folders, as scripts/gpu-suite.sh. Logs under $OUT; a summary
# last.   bash scripts/gpu-all.sh [--full-width] [names...]
set -uo pipefail
cd "$(dirname "$0")/.."
# the device returns at most 8 files from $OUT: everything is written under $out and packed at the end into
# $final/gpu-logs.tar.xz, next to each suite's own log
final="${OUT:-$PWD/gpu-out}"; out=/tmp/gpu-all-out; rm -rf "$out"; mkdir -p "$out/serving" "$final"
bash .gpu/setup.sh > "$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
# shellcheck disable=SC1091
source .gpu/env
if [ -f .peers/flash_mla.tar.xz ]; then
  mkdir -p /tmp/peers && tar -C /tmp/peers -xJf .peers/flash_mla.tar.xz && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
export SERVING_LOG_DIR="$out/serving"
# several pytest processes score on the host at once: without a cap each takes every core (the 2026-12-02
# run of all five at once timed out in the reference scoring)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-3}"
export PYTEST_INSTAFAIL=1  # tracebacks as they happen (tests/conftest.py): a timed-out suite still shows them
names=(group_bf16 group_fp8 kernel_path echo kernels layer_impl hicache)
if [ "${1:-}" = "--full-width" ]; then names+=(full_width); shift; fi
[ $# -gt 0 ] && names=("$@")
run() {  # name, mem fraction, pytest args...
  local name=$1 frac=$2; shift 2
  SERVING_MEM_FRACTION=$frac OUT="$out/$name" timeout "${SUITE_TIMEOUT:-540}" \
    python3 -m pytest -q -rs -s --junitxml="$out/$name.xml" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?" >> "$out/$name.log"
}
pids=()
for n in "${names[@]}"; do
  case $n in
    full_width) run full_width 0.5 tests/serving/test_full_width_gpu.py & ;;
    group_bf16) run group_bf16 0.1 tests/serving/test_server_gpu.py -k "${GROUP_BF16_K:-bf16_kv_group}" & ;;
    group_fp8) run group_fp8 0.1 tests/serving/test_server_gpu.py -k "${GROUP_FP8_K:-fp8_group}" & ;;
    kernel_path) run kernel_path 0.1 tests/serving/test_kernel_path_gpu.py & ;;
    echo) run echo 0.1 tests/echo/test_echo_gpu.py & ;;
    kernels) run kernels 0.1 tests/kernels & ;;
    deterministic) run deterministic 0.1 tests/serving/test_deterministic_gpu.py & ;;
    det_plain) run det_plain 0.1 tests/serving/test_deterministic_gpu.py -k "not echo" & ;;
    det_echo) run det_echo 0.1 tests/serving/test_deterministic_gpu.py -k echo & ;;
    draft_graph) run draft_graph 0.1 tests/echo/test_draft_graph_gpu.py & ;;
    layer_impl) run layer_impl 0.1 tests/serving/test_layer_impl_gpu.py & ;;
    hicache) run hicache 0.1 tests/serving/test_hicache_gpu.py & ;;
    *) echo "unknown suite $n"; exit 2 ;;
  esac
  pids+=($!); sleep 3
done
wait "${pids[@]}"
for n in "${names[@]}"; do [ -f "$out/$n.log" ] && cp "$out/$n.log" "$final/"; done
tar -C "$(dirname "$out")" -cJf "$final/gpu-logs.tar.xz" "$(basename "$out")"
echo "== summary"
for n in "${names[@]}"; do
  f="$out/$n.log"; [ -f "$f" ] || continue
  echo "-- $n"; grep -E "^\[|^\| |echo-result|passed|failed|rc=|^E   " "$f" | cut -c1-400 | tail -30
done
