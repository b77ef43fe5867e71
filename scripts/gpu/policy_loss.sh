#!/usr/bin/env bash
# policy_loss.sh OUT [PARTS_DIR ...]: issue 31's figures on one CUDA GPU, in one call, from the
# repository root with .gpu-wheels/small and .gpu-wheels/install-wheels carried (and the CuTe DSL
# runtime's pieces in PARTS_DIRs for Liger's SM90 kernel: see stash_part.sh; without them Liger's
# kernel is reported unavailable and the rest runs):
#   1. the wheels and the project, installed as run_all.sh installs them;
#   2. fusedhead bench --case policy: triton, unfused:triton, liger-direct, torch, unfused:torch
#      (bf16, H = 4096, V = 151936, T = 0.7, N = 8192 and 32768) -> OUT/policy.json, policy.md;
#   3. policy_loss_bench.py: the triton backend's memory choices and a smaller chunk (PLB_IMPLS
#      sets the list), determinism -> OUT/plb/policy_loss_bench.json;
#   4. fusedhead check {triton,torch} --device cuda --dtype {bf16,fp16} -k policy -> OUT/checks.log;
#   5. policy_host_profile.py fused:triton 8192: the host's Python time in one step (what an idle
#      GPU waits for) -> OUT/host_profile.log.
# Limits (s): BENCH_LIMIT 300 (BENCH_MINUTES 4 of bench time cap), PLB_LIMIT 120, CHECK_LIMIT 90,
# HOST_LIMIT 60; PLB_LIMIT=0 skips step 3. BENCH_IMPLS sets step 2's list.
set -uo pipefail
OUT=${1:?usage: policy_loss.sh OUT [PARTS_DIR ...]}
shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp) # the tree, in every record
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WHEELS=${WHEELS:-.gpu-wheels}
{
  parts=$(mktemp -d)
  [[ $# -gt 0 ]] && bash "$HERE/join_parts.sh" "$parts" "$@"
  bash "$WHEELS/install-wheels" "$WHEELS/small" "$parts"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
tail -n 6 "$OUT/setup.log"
timeout -k 10 "${BENCH_LIMIT:-300}" python3 -m fusedhead.cli bench --device cuda --dtype bf16 \
  --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 --case policy \
  --max-minutes "${BENCH_MINUTES:-4}" --impl ${BENCH_IMPLS:-triton unfused:triton liger-direct torch unfused:torch} \
  --json "$OUT/policy.json" --markdown "$OUT/policy.md" >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
tail -n 14 "$OUT/bench.log"
[[ ${PLB_LIMIT:-120} == 0 ]] || timeout -k 10 "${PLB_LIMIT:-120}" python3 "$HERE/policy_loss_bench.py" "$OUT/plb" --reps 5 --accuracy-n 8192 \
  --impl ${PLB_IMPLS:-fused:triton fused:triton:memory=fast fused:triton:policy_chunk_rows=1536 unfused:triton} \
  >"$OUT/plb.log" 2>&1
echo "policy_loss_bench exit $?" >>"$OUT/plb.log"
tail -n 10 "$OUT/plb.log"
for b in triton torch; do
  for dt in bf16 fp16; do
    timeout -k 10 "${CHECK_LIMIT:-90}" python3 -m fusedhead.cli check "$b" --device cuda --dtype $dt -k policy
    echo "check $b $dt exit $?"
  done
done >"$OUT/checks.log" 2>&1
tail -n 20 "$OUT/checks.log"
timeout -k 10 "${HOST_LIMIT:-60}" python3 "$HERE/policy_host_profile.py" fused:triton 8192 \
  >"$OUT/host_profile.log" 2>&1
echo "host profile exit $?" >>"$OUT/host_profile.log"
head -n 3 "$OUT/host_profile.log"
