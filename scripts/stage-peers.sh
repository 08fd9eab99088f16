#!/usr/bin/env bash
# Here, once per checkout (after ../shared/gpu/stage.sh): packs the FlashMLA peer (the sgl-flash-mla wheel
# SGLang 0.5.23 depends on) as .peers/flash_mla.tar.xz (8.4 MB; xz instead of the wheel's 9.9 MB zip, so it
# travels together with the 56 MB SGLang runtime under the device's 64 MiB limit). gpu-suite.sh unpacks it
# on the device and puts it on PYTHONPATH. Carry [".gpu", ".peers"].
set -euo pipefail
cd "$(dirname "$0")/.."
whl=$(readlink -f ../shared/gpu/peers/sgl_flash_mla-*.whl)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && python3 -m zipfile -e "$whl" .)
mkdir -p .peers && tar -C "$tmp" -cJf .peers/flash_mla.tar.xz flash_mla
echo "staged: $(du -h .peers/flash_mla.tar.xz | cut -f1) .peers/flash_mla.tar.xz (git-ignored); carry it with .gpu"
