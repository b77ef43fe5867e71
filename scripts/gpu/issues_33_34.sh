#!/usr/bin/env bash
# issues_33_34.sh OUT: issue 33's and 34's H200 checks in one call (one install), from the
# repository root on any CUDA machine with torch and triton. This tree and TRL (no deps) are
# installed by scripts/gpu/setup_tree.sh --liger --trl: from pip's index, or, on a machine without
# one such as the one lent here, from a carried .gpu-wheels/{small,install-wheels} and
# .whl/trl-*.whl; the script stops with status 1 when that fails, and exits 1 when a step failed:
#   degree_invariance.py (33 A: triton bf16 shards of degree 2/4/8 against the one-process bits, the
#   combine's cost), ignored_rows_check.py (33 B: NaN/Inf ignored rows, double backward refused),
#   policy_step_bench.py (34: one GRPO policy step at a Qwen2-shaped head, three paths).
set -uo pipefail
OUT=${1:?usage: issues_33_34.sh OUT}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --trl --env || exit 1
run() { # run NAME LIMIT CMD...: CMD's output in OUT/NAME.log, "NAME exit N" at its end
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  record "$name" $? >>"$OUT/$name.log"
  tail -n 12 "$OUT/$name.log"
}
run degree_invariance "${DI_LIMIT:-200}" python3 "$HERE/degree_invariance.py" "$OUT"
rm -rf "$OUT/degree_invariance_tmp"
run ignored_rows "${IR_LIMIT:-130}" python3 "$HERE/ignored_rows_check.py" "$OUT"
run policy_step "${PS_LIMIT:-120}" python3 "$HERE/policy_step_bench.py" "$OUT" --repeats 5
finish
