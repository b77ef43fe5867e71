#!/usr/bin/env bash
# final_check.sh OUT: one call that checks a tree on one CUDA GPU, from the repository root on any
# CUDA machine with torch and triton; the tree is installed first by scripts/gpu/setup_tree.sh
# (from pip's index, or from a carried .gpu-wheels/{small,install-wheels} on a machine without one,
# such as the one lent here; status 1 when that fails):
#   1. pytest -m gpu tests/policy (the policy loss's GPU tests: the triton policy log-probs as
#      fused_head's bits, bf16 weight-gradient rounding) -> OUT/pytest.log;
#   2. fusedhead check triton --device cuda --dtype bf16, the whole kit -> OUT/kit.log;
#   3. fusedhead bench --case policy, triton and unfused:triton, the issue's case -> OUT/policy.json.
# Limits (s): PYTEST_LIMIT 120, KIT_LIMIT 200, BENCH_LIMIT 200. Every step runs; each log ends
# "NAME exit N" and the exit status is 1 when any step failed.
set -uo pipefail
OUT=${1:?usage: final_check.sh OUT}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" || exit 1
timeout -k 5 "${PYTEST_LIMIT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/policy \
  >"$OUT/pytest.log" 2>&1
record pytest $? >>"$OUT/pytest.log"
tail -n 3 "$OUT/pytest.log"
timeout -k 5 "${KIT_LIMIT:-200}" python3 -m fusedhead.cli check triton --device cuda --dtype bf16 \
  >"$OUT/kit.log" 2>&1
record kit $? >>"$OUT/kit.log"
tail -n 2 "$OUT/kit.log"
timeout -k 5 "${BENCH_LIMIT:-200}" python3 -m fusedhead.cli bench --device cuda --dtype bf16 \
  --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 --case policy \
  --impl triton unfused:triton --max-minutes 3 --json "$OUT/policy.json" \
  --markdown "$OUT/policy.md" >"$OUT/bench.log" 2>&1
record bench $? >>"$OUT/bench.log"
tail -n 8 "$OUT/policy.md"
finish
