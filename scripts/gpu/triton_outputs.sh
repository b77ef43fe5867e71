#!/usr/bin/env bash
# triton_outputs.sh [bench|tests|sweep|all] [OUT]: issue 18's GPU run of the triton backend's outputs
# (top-k, gather, lse, sum_p2, argmax, the KL of two heads), from the repository root on any CUDA
# machine with torch and triton. Each call installs this tree first (scripts/gpu/setup_tree.sh:
# from pip's index, or, on a machine without one such as the one lent here, from a carried
# .gpu-wheels/{small,install-wheels}) and stops with status 1 when that fails; it exits 1 when a
# step failed. Outputs in OUT (default $OUT or ./.gpu-out):
#   (every call) setup.log
#   bench  heads.json (+ heads.log): `fusedhead bench --case ...` on triton, N = 8192
#   tests  pytest.log (pytest -m gpu -v tests/triton_backend, the outputs' files first: one line a
#          test, so a run cut by its limit still names each result), check.log (the kit in bf16)
#   sweep  sweep.log, kl_sweep.json: the KL's tile alternatives (TOPK_BENCH=1 adds topk_bench.json,
#          the top-k's steps)
# "all" is bench and tests (about 15 minutes: two calls of a 10-minute limit, bench then tests).
set -uo pipefail
STEP=${1:-all}
case $STEP in
bench | tests | sweep | all) ;;
*)
  echo "usage: triton_outputs.sh [bench|tests|sweep|all] [OUT]" >&2
  exit 2
  ;;
esac
OUT=${2:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # run LIMIT_S LOG CMD...; finish
source "$HERE/setup_tree.sh" "$OUT/setup.log" --env || exit 1
if [[ $STEP == bench || $STEP == all ]]; then
  run "${BENCH_LIMIT:-330}" "$OUT/heads.log" python3 -m fusedhead.cli bench --device cuda \
    --dtype bf16 --n 8192 --hidden 4096 --vocab 151936 --temperature 0.7 --impl triton \
    --case ${BENCH_CASES:-logprobs topk32 gather32 kl kl-reverse lse sum_p2 argmax} \
    --max-minutes "${BENCH_MINUTES:-5}" --json "$OUT/heads.json"
fi
if [[ $STEP == tests || $STEP == all ]]; then
  T=tests/triton_backend
  # One process by default: on one H100 (2026-12-05) four xdist workers sharing the GPU failed 26
  # tests (one worker every test from one on, as after a sticky CUDA error) that pass in one
  # process (docs/benchmarks.md). PYTEST_WORKERS=N shares the GPU among N (Triton's compile on the
  # host is most of a test's time), where pytest-xdist imports.
  workers=()
  if python3 -c "import xdist" 2>/dev/null && [[ ${PYTEST_WORKERS:-0} != 0 ]]; then
    workers=(-n "${PYTEST_WORKERS}")
  fi
  run "${PYTEST_LIMIT:-360}" "$OUT/pytest.log" python3 -m pytest -m gpu -v -rfEs "${workers[@]}" \
    -p no:cacheprovider $T/test_triton_outputs_gpu.py $T/test_triton_topk_gpu.py \
    $T/test_triton_kl_gpu.py $T ${PYTEST_K:+-k "$PYTEST_K"}
  run "${CHECK_LIMIT:-180}" "$OUT/check.log" python3 -m fusedhead.cli check triton \
    --device cuda --dtype bf16
fi
if [[ $STEP == sweep ]]; then # the KL's tiles (one 10-minute call at most); TOPK_BENCH=1 adds topk's
  run "${SWEEP_LIMIT:-560}" "$OUT/sweep.log" python3 plugins/triton_backend/tools/kl_sweep.py \
    "$OUT" --budget-s "${SWEEP_BUDGET_S:-480}"
  if [[ ${TOPK_BENCH:-0} == 1 ]]; then
    run "${TOPK_LIMIT:-150}" "$OUT/sweep.log" python3 plugins/triton_backend/tools/topk_bench.py \
      --out "$OUT"
  fi
fi
for f in "$OUT"/*.log; do
  echo "## $(basename "$f")"
  grep -E "=====|PASS|FAIL|passed|failed|Error|units" "$f" | tail -n 14
done
finish
