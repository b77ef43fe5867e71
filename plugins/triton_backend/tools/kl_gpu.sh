#!/usr/bin/env bash
# kl_gpu.sh OUT_DIR: the triton KL of two heads (issue 18, part 3) on one CUDA GPU, from the
# repository root with the project installed (PYTHON, default python3, must import it).
#   pytest  tests/triton_backend/test_triton_kl_gpu.py (bf16/fp16/fp32 accuracy, softcap, batch
#           invariance, determinism, forward memory, the kit's kl_accuracy, compile)
#   sweep   tools/kl_sweep.py: fwd and bwd GEMM units of the shipped KL tile and alternatives
#   bench   fusedhead bench --case kl kl-reverse, N = 8192, H = 4096, V = 151936, bf16, triton
#           (BENCH_IMPLS="triton torch" adds torch; targets: fwd <= 2.2 units, fwd+bwd <= 6.5)
# STEPS picks and orders them (default "bench pytest sweep"); each has its own time limit and exit
# status (OUT_DIR/summary.txt), logs and JSON beside it. Defaults fit one 600 s call.
set -uo pipefail
OUT=${1:?usage: kl_gpu.sh OUT_DIR}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
: >"$OUT/summary.txt"
step() {  # step NAME LIMIT_S CMD...: run CMD under a limit, log to OUT/NAME.log, record its status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
}
for s in ${STEPS:-bench pytest sweep}; do
  case $s in
  bench)
    step bench "${BENCH_LIMIT:-200}" "$PY" -m fusedhead.cli bench --device cuda --dtype bf16 \
      --n 8192 --hidden 4096 --vocab 151936 --temperature 0.7 --case kl kl-reverse \
      --impl "${BENCH_IMPLS:-triton}" --max-minutes 3 --json "$OUT/kl_bench.json"
    tail -n 6 "$OUT/bench.log"
    ;;
  pytest)
    step pytest "${PYTEST_LIMIT:-240}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      tests/triton_backend/test_triton_kl_gpu.py
    tail -n 8 "$OUT/pytest.log"
    ;;
  sweep)
    step sweep "${SWEEP_LIMIT:-150}" "$PY" "$HERE/kl_sweep.py" "$OUT" --budget-s "${SWEEP_BUDGET_S:-120}"
    tail -n 14 "$OUT/sweep.log"
    ;;
  *) echo "kl_gpu.sh: unknown step $s (bench, pytest, sweep)" | tee -a "$OUT/summary.txt" ;;
  esac
done
