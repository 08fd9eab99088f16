#!/usr/bin/env bash
# For a staged GPU run of the PD tests (scripts/gpu-suite.sh), once per checkout: packs what SGLang's Mooncake
# transfer needs from the `mooncake-transfer-engine-cuda13` wheel for the GPU machine's Python (cp312, CUDA 13)
# as .peers/mooncake.tar.xz, and, because a staged run carries at most 64 MiB, writes a slimmer copy of the
# staged SGLang runtime as .gpu-pd/ (same layout as .gpu/: carry .gpu-pd instead of .gpu, plus
# .peers/mooncake.tar.xz). Not needed where SGLang and Mooncake are installed with pip.
#
# From the wheel: `mooncake/engine.so` (SGLang's `from mooncake.engine import TransferEngine`), the two libraries
# it links from the package (libasio, libetcd_wrapper) and from the wheel's .libs (glog, gflags, jsoncpp,
# yaml-cpp), plus the system libraries it links that a bare machine may lack (libibverbs, libmlx5, libnuma,
# libcurl and theirs, from this machine's Debian). gpu-suite.sh appends them to LD_LIBRARY_PATH, so the GPU
# machine's own copies win where it has them. The store, EP, PG, master and client binaries stay out: SGLang's
# PD transfer never imports them.
#
# Dropped from the runtime (serving never imports them; `python -X importtime` of the HTTP server, scheduler,
# model runner and both PD schedulers): llguidance (the llguidance grammar backend), openai_harmony (gpt-oss
# chat parsing), Cryptodome (blobfile), airportsdata (outlines' airport type), kernels / kernels_data (the
# Hugging Face kernel hub), the CUDA 12 builds of torch_memory_saver, and torch_c_dlpack_ext (setup.sh removes
# it on the machine anyway).
#   pip download mooncake-transfer-engine-cuda13 --python-version 3.12 --only-binary=:all: --no-deps -d DIR
#   bash scripts/stage-mooncake.sh DIR/mooncake_transfer_engine_cuda13-*-cp312-*.whl
set -euo pipefail
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: bash scripts/stage-mooncake.sh path/to/mooncake_transfer_engine_cuda13-<version>-cp312-<tags>.whl" >&2
  exit 2
fi
whl=$(readlink -f "$1")
cd "$(dirname "$0")/.."
runtime=.gpu/sglang-0.5.23-runtime-py312-torch211.tar.xz
[ -f "$runtime" ] || { echo "no staged runtime at $runtime: stage .gpu first" >&2; exit 2; }

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "[stage-mooncake] unpacking $(basename "$whl")"
(cd "$tmp" && mkdir wheel && cd wheel && python3 -m zipfile -e "$whl" .)
libs=$(cd "$tmp/wheel" && ls -d mooncake_transfer_engine*.libs)
mkdir -p "$tmp/mc/mooncake" "$tmp/mc/$libs" "$tmp/mc/syslib"
cp "$tmp/wheel/mooncake/"{__init__.py,engine.so,engine.pyi,libasio.so,libetcd_wrapper.so} "$tmp/mc/mooncake/"
for l in libgflags libglog libjsoncpp libyaml-cpp; do cp "$tmp/wheel/$libs/$l"-* "$tmp/mc/$libs/"; done
# the system libraries engine.so links, less the C/C++ runtime the machine has for Python itself
export LD_LIBRARY_PATH="$tmp/wheel/mooncake:$tmp/wheel/$libs"
missing=$(ldd "$tmp/wheel/mooncake/engine.so" | awk '/not found/{print $1}' | grep -v -E '^lib(cuda|cudart)\.' || true)
[ -z "$missing" ] || { echo "this machine lacks libraries engine.so links: $missing (apt-get install libibverbs1 ibverbs-providers libnuma1 libcurl4)" >&2; exit 1; }
for l in $(ldd "$tmp/wheel/mooncake/engine.so" | awk '$3 ~ /^\/(usr\/)?lib/{print $3}'); do
  case $(basename "$l") in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*|libstdc++.so*|libresolv.so*) ;;
    *) cp -L "$l" "$tmp/mc/syslib/" ;;
  esac
done
mkdir -p .peers && tar -C "$tmp/mc" -cJf .peers/mooncake.tar.xz .
echo "[stage-mooncake] staged $(du -h .peers/mooncake.tar.xz | cut -f1) .peers/mooncake.tar.xz"

echo "[stage-mooncake] repacking the runtime without what serving never imports (a few minutes)"
mkdir "$tmp/rt" && tar -C "$tmp/rt" -xJf "$runtime"
(cd "$tmp/rt" && rm -rf llguidance llguidance-*.dist-info openai_harmony openai_harmony-*.dist-info Cryptodome \
  pycryptodomex-*.dist-info airportsdata airportsdata-*.dist-info kernels kernels-*.dist-info kernels_data \
  kernels_data-*.dist-info torch_memory_saver_hook_mode_*_cu12.abi3.so torch_c_dlpack_ext torch_c_dlpack_ext-*.dist-info)
mkdir -p .gpu-pd && cp .gpu/setup.sh .gpu-pd/
tar -C "$tmp/rt" -cf - . | xz -9 -T0 > ".gpu-pd/$(basename "$runtime")"
total=$(( $(stat -c %s ".gpu-pd/$(basename "$runtime")") + $(stat -c %s .peers/mooncake.tar.xz) ))
echo "[stage-mooncake] staged .gpu-pd/ ($(du -h ".gpu-pd/$(basename "$runtime")" | cut -f1)); with Mooncake $((total / 1048576)) MiB of the 64 MiB a run carries"
echo "[stage-mooncake] run with carry [\".gpu-pd\", \".peers/mooncake.tar.xz\"] and GPU_DIR=.gpu-pd bash scripts/gpu-suite.sh ..."
