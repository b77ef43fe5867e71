#!/usr/bin/env bash
# stash_part.sh SRC_DIR DEST: the first call of the two-call dance, needed only where the CuTe DSL
# runtime wheel travels in two pieces (.gpu-wheels/part-a, part-b: the machine lent here, which has
# no package index and takes one piece a call; elsewhere scripts/gpu/setup_tree.sh installs the DSL
# from the index). Copies the wheel pieces carried in SRC_DIR to DEST, a folder outside the
# repository's copy that outlives the call (the machine stays warm between the two calls), where
# the next call finds them: `bash scripts/gpu/run_all.sh --out OUT DEST .gpu-wheels/part-b` (or
# policy_loss.sh OUT .gpu-wheels/part-b DEST, triton_v2.sh bench OUT DEST). Exits non-zero when
# nothing was copied.
set -euo pipefail
src=${1:?usage: stash_part.sh SRC_DIR DEST}
dest=${2:?usage: stash_part.sh SRC_DIR DEST (DEST: a folder that outlives this call)}
mkdir -p "$dest"
cp "$src"/*.part-* "$dest"/
ls -l "$dest"
nvidia-smi -L || true
