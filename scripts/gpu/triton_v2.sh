#!/usr/bin/env bash
# triton_v2.sh stash|bench [OUT]: the triton backend's GPU runs (issue 17) in two calls on one warm H200,
# from the repository root, with .gpu-wheels/{small,install-wheels} carried and part-a (stash) or
# part-b (bench) of the CuTe DSL wheel (shared/gpu/prepare-wheels makes them).
#   stash  keeps part-a on the machine for the next call, installs the small wheels and the
#          project, profiles the backward kernel by kernel (tools/gpu_check.py; ncu on the dh kernel
#          where the profiler reads counters), then pytest -m gpu tests/triton_backend.
#   bench  run_all.sh's install + bench (liger-direct, then triton in its own process), then a
#          second triton process into bench-again.json: the two triton runs' agreement.
# Outputs in OUT (default $OUT, else ./.gpu-out; at most 8 files).
set -uo pipefail
OUT=${2:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOL=plugins/triton_backend/tools/gpu_check.py
case ${1:-} in
stash)
  bash "$HERE/stash_part.sh" .gpu-wheels/part-a >"$OUT/setup.log" 2>&1
  bash .gpu-wheels/install-wheels .gpu-wheels/small >>"$OUT/setup.log" 2>&1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend >>"$OUT/setup.log" 2>&1
  python3 "$HERE/env_report.py" >>"$OUT/setup.log" 2>&1
  timeout 150 python3 "$TOOL" --n "${PROFILE_N:-8192,32768}" --out "$OUT" >"$OUT/profile.log" 2>&1
  if command -v ncu >/dev/null; then
    timeout "${NCU_LIMIT:-90}" ncu --kernel-name regex:dh_tma --launch-skip 2 --launch-count 1 \
      --section LaunchStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy python3 "$TOOL" --once --n 8192 --memory low >"$OUT/ncu.txt" 2>&1
    echo "ncu exit $?" >>"$OUT/ncu.txt"
  fi
  timeout "${PYTEST_LIMIT:-200}" python3 -m pytest -m gpu tests/triton_backend -q -rfEs \
    -p no:cacheprovider -k "${PYTEST_K:-not kit_property or bf16}" >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest.log"
  tail -n 25 "$OUT/pytest.log"
  grep -v '^ ' "$OUT/profile.log" | tail -n 12
  ;;
bench)
  STEPS="install bench" BENCH_IMPLS=${BENCH_IMPLS:-liger-direct} BENCH_LAST_IMPLS=triton \
    BENCH_MINUTES=${BENCH_MINUTES:-2} BENCH_LAST_MINUTES=${BENCH_LAST_MINUTES:-2} \
    DEADLINE_S=${DEADLINE_S:-420} bash "$HERE/run_all.sh" --out "$OUT" \
    /tmp/fusedhead-wheel-parts .gpu-wheels/part-b
  timeout 200 python3 -m fusedhead.cli bench --device cuda --dtype bf16 --n 8192 32768 \
    --hidden 4096 --vocab 151936 --temperature 0.7 --impl triton --max-minutes 2 \
    --json "$OUT/bench-again.json" >"$OUT/bench-again.log" 2>&1
  tail -n 12 "$OUT/bench-again.log"
  ;;
*)
  echo "usage: triton_v2.sh stash|bench [OUT]" >&2
  exit 2
  ;;
esac
