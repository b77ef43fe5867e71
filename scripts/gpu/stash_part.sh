#!/usr/bin/env bash
# stash_part.sh SRC_DIR [DEST]: first call of the two-call dance. Copies the wheel pieces carried
# in SRC_DIR to DEST (default /tmp/fusedhead-wheel-parts) on the GPU machine, where the next call,
# made while the machine is still warm, finds them: scripts/gpu/run_all.sh .gpu-wheels/part-b DEST
set -euo pipefail
src=$1
dest=${2:-/tmp/fusedhead-wheel-parts}
mkdir -p "$dest"
cp "$src"/*.part-* "$dest"/
ls -l "$dest"
nvidia-smi -L || true
