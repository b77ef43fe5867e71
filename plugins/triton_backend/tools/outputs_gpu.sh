#!/usr/bin/env bash
# outputs_gpu.sh OUT_DIR: the triton backend's lse, sum_p2, argmax, gather and top-k (issue 18,
# part 1) on one CUDA GPU, from the repository root with the project installed (PYTHON, default
# python3, must import it).
#   bench   fusedhead bench --case logprobs topk32 gather32 lse sum_p2 argmax, N = 8192,
#           H = 4096, V = 151936, bf16, triton (BENCH_IMPLS="triton torch" adds torch; targets:
#           top-k fwd <= 1.25 units, gather fwd <= 1.1, gather fwd+bwd <= 4.6)
#   pytest  tests/triton_backend/test_triton_outputs_gpu.py (bf16/fp16/fp32 against float64,
#           bitwise gather/top-k, batch invariance, determinism, gather's forward memory)
#   kit     the kit's output properties on CUDA in bf16 (test_triton_gpu.py)
# STEPS picks and orders them (default "bench pytest kit"); each has its own time limit and exit
# status (OUT_DIR/summary.txt), its log beside it.
set -uo pipefail
OUT=${1:?usage: outputs_gpu.sh OUT_DIR}
PY=${PYTHON:-python3}
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
for s in ${STEPS:-bench pytest kit}; do
  case $s in
  bench)
    step bench "${BENCH_LIMIT:-300}" "$PY" -m fusedhead.cli bench --device cuda --dtype bf16 \
      --n 8192 --hidden 4096 --vocab 151936 --temperature 0.7 \
      --case logprobs topk32 gather32 lse sum_p2 argmax --impl "${BENCH_IMPLS:-triton}" \
      --max-minutes 4 --json "$OUT/outputs_bench.json" --markdown "$OUT/outputs_bench.md"
    tail -n 10 "$OUT/bench.log"
    ;;
  pytest)
    step pytest "${PYTEST_LIMIT:-300}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      tests/triton_backend/test_triton_outputs_gpu.py
    tail -n 8 "$OUT/pytest.log"
    ;;
  kit)
    step kit "${KIT_LIMIT:-240}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
      tests/triton_backend/test_triton_gpu.py -k \
      "kit and bf16 and (topk or argmax or gather or lse or extras_together or batch_invariant_extras)"
    tail -n 8 "$OUT/kit.log"
    ;;
  *) echo "outputs_gpu.sh: unknown step $s (bench, pytest, kit)" | tee -a "$OUT/summary.txt" ;;
  esac
done
