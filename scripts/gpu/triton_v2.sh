#!/usr/bin/env bash
# triton_v2.sh stash|bench [OUT [STASH]]: the triton backend's GPU runs (issue 17) in two calls on
# one warm H200, from the repository root on any CUDA machine with torch and triton. Each call
# installs this tree (scripts/gpu/setup_tree.sh --liger: from pip's index, with the CuTe DSL for
# Liger's SM90 kernel; or, on a machine without one such as the one lent here, from a carried
# .gpu-wheels/{small,install-wheels}, the CuTe DSL wheel then in two pieces, .gpu-wheels/part-a and
# part-b, one carried in each call); it exits 1 when the install or any step failed.
#   stash  with STASH (a folder outside the repository's copy that outlives the call) and part-a
#          carried: keeps part-a there for the next call (stash_part.sh); then installs the project,
#          profiles the backward kernel by kernel (tools/gpu_check.py; ncu on the dh kernel where
#          the profiler reads counters), then pytest -m gpu tests/triton_backend.
#   bench  run_all.sh's install + bench (liger-direct, then triton in its own process; the CuTe DSL
#          pieces joined from STASH and part-b when given), then a second triton process into
#          bench-again.json: the two triton runs' agreement.
# Outputs in OUT (default $OUT, else ./.gpu-out; at most 8 files).
set -uo pipefail
MODE=${1:-}
OUT=${2:-${OUT:-$PWD/.gpu-out}}
STASH=${3:-}
WHEELS=${WHEELS:-.gpu-wheels}
case $MODE in
stash | bench) ;;
*)
  echo "usage: triton_v2.sh stash|bench [OUT [STASH]]" >&2
  exit 2
  ;;
esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp) # the tree, in every record
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
TOOL=plugins/triton_backend/tools/gpu_check.py
case $MODE in
stash)
  : >"$OUT/setup.log"
  if [[ -n $STASH ]]; then
    bash "$HERE/stash_part.sh" "$WHEELS/part-a" "$STASH" >>"$OUT/setup.log" 2>&1
    record stash_part $? >>"$OUT/setup.log"
  fi
  source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env || exit 1
  timeout 150 python3 "$TOOL" --n "${PROFILE_N:-8192,32768}" --out "$OUT" >"$OUT/profile.log" 2>&1
  record profile $? >>"$OUT/profile.log"
  if command -v ncu >/dev/null; then
    timeout "${NCU_LIMIT:-90}" ncu --kernel-name regex:dh_tma --launch-skip 2 --launch-count 1 \
      --section LaunchStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy python3 "$TOOL" --once --n 8192 --memory low >"$OUT/ncu.txt" 2>&1
    record ncu $? >>"$OUT/ncu.txt"
  fi
  timeout "${PYTEST_LIMIT:-200}" python3 -m pytest -m gpu tests/triton_backend -q -rfEs \
    -p no:cacheprovider -k "${PYTEST_K:-not kit_property or bf16}" >"$OUT/pytest.log" 2>&1
  record pytest $? >>"$OUT/pytest.log"
  tail -n 25 "$OUT/pytest.log"
  grep -v '^ ' "$OUT/profile.log" | tail -n 12
  ;;
bench)
  parts=()
  [[ -n $STASH ]] && parts+=("$STASH")
  [[ -d $WHEELS/part-b ]] && parts+=("$WHEELS/part-b")
  STEPS="install bench" BENCH_IMPLS=${BENCH_IMPLS:-liger-direct} BENCH_LAST_IMPLS=triton \
    BENCH_MINUTES=${BENCH_MINUTES:-2} BENCH_LAST_MINUTES=${BENCH_LAST_MINUTES:-2} \
    DEADLINE_S=${DEADLINE_S:-420} WHEELS=$WHEELS bash "$HERE/run_all.sh" --out "$OUT" \
    ${parts[@]+"${parts[@]}"}
  rc=$?
  record run_all "$rc"
  if ((rc != 0)) && ! python3 "$HERE/tree_installed.py" . >/dev/null 2>&1; then
    echo "this tree is not what imports: no second triton process" >&2
    finish
  fi
  timeout 200 python3 -m fusedhead.cli bench --device cuda --dtype bf16 --n 8192 32768 \
    --hidden 4096 --vocab 151936 --temperature 0.7 --impl triton --max-minutes 2 \
    --json "$OUT/bench-again.json" >"$OUT/bench-again.log" 2>&1
  record bench-again $? >>"$OUT/bench-again.log"
  tail -n 12 "$OUT/bench-again.log"
  ;;
esac
finish
