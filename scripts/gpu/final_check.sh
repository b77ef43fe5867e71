#!/usr/bin/env bash
# final_check.sh OUT: one call that checks a tree on one CUDA GPU, from the repository root with
# .gpu-wheels/small and .gpu-wheels/install-wheels carried:
#   1. pytest -m gpu tests/policy (the policy loss's GPU tests: the triton policy log-probs as
#      fused_head's bits, bf16 weight-gradient rounding) -> OUT/pytest.log;
#   2. fusedhead check triton --device cuda --dtype bf16, the whole kit -> OUT/kit.log;
#   3. fusedhead bench --case policy, triton and unfused:triton, the issue's case -> OUT/policy.json.
# Limits (s): PYTEST_LIMIT 120, KIT_LIMIT 200, BENCH_LIMIT 200.
set -uo pipefail
OUT=${1:?usage: final_check.sh OUT}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/setup_tree.sh" "$OUT/setup.log"
timeout -k 5 "${PYTEST_LIMIT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/policy \
  >"$OUT/pytest.log" 2>&1
echo "pytest exit $?" >>"$OUT/pytest.log"
tail -n 3 "$OUT/pytest.log"
timeout -k 5 "${KIT_LIMIT:-200}" python3 -m fusedhead.cli check triton --device cuda --dtype bf16 \
  >"$OUT/kit.log" 2>&1
echo "kit exit $?" >>"$OUT/kit.log"
tail -n 2 "$OUT/kit.log"
timeout -k 5 "${BENCH_LIMIT:-200}" python3 -m fusedhead.cli bench --device cuda --dtype bf16 \
  --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 --case policy \
  --impl triton unfused:triton --max-minutes 3 --json "$OUT/policy.json" \
  --markdown "$OUT/policy.md" >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
tail -n 8 "$OUT/policy.md"
