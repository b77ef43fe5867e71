#!/usr/bin/env bash
# issue33a.sh [OUT]: issue 33 part A on one H200, from the repository root, with .gpu-wheels/small
# and .gpu-wheels/install-wheels carried (shared/gpu/prepare-wheels makes them), in one call:
#   1. the wheels and the project installed as run_all.sh installs them (no index, no deps);
#   2. scripts/gpu/degree_invariance.py: triton bf16 at N = 8192, H = 4096, V = 151936, the
#      shards of degree 2, 4 and 8 (eight ranks on the one GPU, gloo) against the one-process
#      bits (log_probs, entropy, lse, sum_p2, gathered, argmax), degree 8 on equal (off-grid)
#      shards for the record, and the combine's time against forward + backward
#      -> OUT/degree_invariance.json, OUT/degree_invariance.log.
# About 3 minutes. Outputs in OUT (default $OUT, else ./.gpu-out).
set -uo pipefail
OUT=${1:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
timeout 240 python3 "$HERE/degree_invariance.py" "$OUT" >"$OUT/degree_invariance.log" 2>&1
echo "degree_invariance exit $?" >>"$OUT/degree_invariance.log"
rm -rf "$OUT/degree_invariance_tmp"
tail -n 30 "$OUT/degree_invariance.log"
