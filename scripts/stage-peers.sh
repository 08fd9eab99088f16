#!/usr/bin/env bash
# For a staged GPU run (scripts/gpu-suite.sh), once per checkout: packs the FlashMLA peer (the sgl-flash-mla
# wheel SGLang 0.5.23 depends on; give its path) as .peers/flash_mla.tar.xz (8.4 MB; xz
# instead of the wheel's 9.9 MB zip, small enough to travel with a staged runtime). gpu-suite.sh unpacks it on
# the GPU machine and puts it on PYTHONPATH. Not needed where SGLang is installed with pip (it brings
# sgl-flash-mla).
#   bash scripts/stage-peers.sh path/to/sgl_flash_mla-*.whl
set -euo pipefail
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: bash scripts/stage-peers.sh path/to/sgl_flash_mla-<version>-<tags>.whl (e.g. from 'pip download sgl-flash-mla --no-deps')" >&2
  exit 2
fi
whl=$(readlink -f "$1")
cd "$(dirname "$0")/.."

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && python3 -m zipfile -e "$whl" .)
mkdir -p .peers && tar -C "$tmp" -cJf .peers/flash_mla.tar.xz flash_mla
echo "staged: $(du -h .peers/flash_mla.tar.xz | cut -f1) .peers/flash_mla.tar.xz (git-ignored); carry it with .gpu"
