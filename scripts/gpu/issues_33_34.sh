#!/usr/bin/env bash
# issues_33_34.sh OUT: issue 33's and 34's H200 checks in one call (one install), from the
# repository root with .gpu-wheels/{small,install-wheels} and .whl/trl-*.whl carried:
#   degree_invariance.py (33 A: triton bf16 shards of degree 2/4/8 against the one-process bits, the
#   combine's cost), ignored_rows_check.py (33 B: NaN/Inf ignored rows, double backward refused),
#   policy_step_bench.py (34: one GRPO policy step at a Qwen2-shaped head, three paths).
set -uo pipefail
OUT=${1:?usage: issues_33_34.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend
  python3 -m pip install -q --no-index --no-deps .whl/trl-*.whl
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
run() { # run NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name exit $?" >>"$OUT/$name.log"
  tail -n 12 "$OUT/$name.log"
}
run degree_invariance "${DI_LIMIT:-200}" python3 "$HERE/degree_invariance.py" "$OUT"
rm -rf "$OUT/degree_invariance_tmp"
run ignored_rows "${IR_LIMIT:-130}" python3 "$HERE/ignored_rows_check.py" "$OUT"
run policy_step "${PS_LIMIT:-120}" python3 "$HERE/policy_step_bench.py" "$OUT" --repeats 5
