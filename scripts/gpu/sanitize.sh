#!/usr/bin/env bash
# sanitize.sh OUT: the triton backend's GPU tests under compute-sanitizer, and again as four
# pytest-xdist workers sharing the GPU (where a run of 2026-12-05 failed 26 tests that pass in one
# process; docs/benchmarks.md). From the repository root on any CUDA machine with torch, triton
# and compute-sanitizer; this tree is installed first by scripts/gpu/setup_tree.sh (from pip's
# index, or from a carried .gpu-wheels/{small,install-wheels} on a machine without one, such as
# the one lent here; status 1 when that fails), and the exit status is 1 when a step failed:
#   memcheck.log  memcheck of MEMCHECK_FILES -k MEMCHECK_K (default: the tests that stash the
#                 weight gradient's sum in its rows, the head's `memory: low`, and the outputs at
#                 N = 1937; memcheck runs without torch's caching allocator, so the tests that
#                 read its peak skip) (MEMCHECK_LIMIT, 240 s);
#   xdist.log     pytest -n XDIST_WORKERS (4) -x --tb=short of XDIST_FILES -k XDIST_K (default:
#                 all of tests/triton_backend in the 2026-12-05 order), with CUDA_LAUNCH_BLOCKING=1 so
#                 that a failing launch names itself (XDIST_LIMIT, 300 s).
set -uo pipefail
OUT=${1:?usage: sanitize.sh OUT}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # run LIMIT_S LOG CMD...; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" || exit 1
T=tests/triton_backend
run "${MEMCHECK_LIMIT:-240}" "$OUT/memcheck.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 9 \
  python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short \
  ${MEMCHECK_FILES:-$T/test_triton_gpu.py $T/test_triton_outputs_gpu.py} \
  -k "${MEMCHECK_K:-low_memory or odd_sizes or 1937}"
tail -n 6 "$OUT/memcheck.log"
if python3 -c "import xdist" 2>/dev/null; then
  run "${XDIST_LIMIT:-300}" "$OUT/xdist.log" env CUDA_LAUNCH_BLOCKING=1 \
    python3 -m pytest -m gpu -v -rfE --tb=short -n "${XDIST_WORKERS:-4}" -x -p no:cacheprovider \
    ${XDIST_FILES:-$T/test_triton_outputs_gpu.py $T/test_triton_topk_gpu.py $T/test_triton_kl_gpu.py $T} \
    -k "${XDIST_K:-}"
  tail -n 6 "$OUT/xdist.log"
else
  echo "pytest-xdist does not import: no four-worker run" | tee "$OUT/xdist.log"
fi
finish
