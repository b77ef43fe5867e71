#!/usr/bin/env bash
# torch_head.sh OUT: the torch backend's figures on one CUDA GPU in one call (issue 33's <= 6.3
# GEMM units for the head, issue 31's <= 4.5 for its policy loss), from the repository root on any
# CUDA machine with torch and triton:
#   1. this tree installed by scripts/gpu/setup_tree.sh --liger (from pip's index, or from a carried
#      .gpu-wheels/{small,install-wheels} on a machine without one, such as the one lent here);
#      when that fails the script stops with status 1;
#   2. fusedhead bench (log-probs + entropy, fwd and fwd+bwd; bf16, H = 4096, V = 151936, T = 0.7,
#      N = 8192 and 32768): torch (its default: the backward's dz compiled), torch with
#      compile_elementwise off (the eager passes), triton -> OUT/head.json, head.md;
#   3. fusedhead bench --case policy at N = 8192: torch, triton -> OUT/policy.json, policy.md;
#   4. tiny_temperatures.py (finite outputs and gradients at small T, every backend) -> OUT;
#   5. pytest -m gpu of tests/torch_backend and tests/policy (their CUDA tests; any other session
#      on a CUDA machine is the CPU suite, the GPU hidden: tests/suite_sessions.py), with the
#      backward's recompute in the forward's GEMM shapes (test_torch_recompute_cuda.py).
# Limits per step: HEAD_LIMIT (220 s), POLICY_LIMIT (100), TINY_LIMIT (60), PYTEST_LIMIT (120).
# Every step runs; the exit status is 1 when any failed (its log ends "NAME exit N").
set -uo pipefail
OUT=${1:?usage: torch_head.sh OUT}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
# The tree, installed and checked; FUSEDHEAD_GIT_COMMIT from .gpu-stamp names it in every record.
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env || exit 1
tail -n 4 "$OUT/setup.log"
run() { # run NAME LIMIT CMD...: CMD's output in OUT/NAME.log, "NAME exit N" at its end
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  record "$name" $? >>"$OUT/$name.log"
  tail -n 14 "$OUT/$name.log"
}
GRID=(--device cuda --dtype bf16 --hidden 4096 --vocab 151936 --temperature 0.7)
run head "${HEAD_LIMIT:-220}" python3 -m fusedhead.cli bench "${GRID[@]}" --n 8192 32768 \
  --max-minutes 3 --impl torch 'torch:{"compile_elementwise": false}' triton \
  --json "$OUT/head.json" --markdown "$OUT/head.md"
run policy "${POLICY_LIMIT:-100}" python3 -m fusedhead.cli bench "${GRID[@]}" --n 8192 \
  --case policy --max-minutes 1.5 --impl torch triton \
  --json "$OUT/policy.json" --markdown "$OUT/policy.md"
run tiny "${TINY_LIMIT:-60}" python3 "$HERE/tiny_temperatures.py" "$OUT"
run pytest "${PYTEST_LIMIT:-120}" python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider -x \
  tests/torch_backend tests/policy
finish
