#!/usr/bin/env bash
# policy_loss.sh OUT [PARTS_DIR ...]: issue 31's figures on one CUDA GPU, in one call, from the
# repository root on any CUDA machine with torch and triton:
#   1. this tree installed by scripts/gpu/setup_tree.sh --liger: from pip's index (Liger's SM90
#      kernel with it), or, on a machine without one such as the one lent here, from a carried
#      .gpu-wheels/{small,install-wheels}, with the CuTe DSL runtime's pieces in PARTS_DIRs for
#      Liger's SM90 kernel (see stash_part.sh; without them Liger's kernel is reported unavailable
#      and the rest runs); when the install fails the script stops with status 1;
#   2. fusedhead bench --case policy: triton, unfused:triton, liger-direct, torch, unfused:torch
#      (bf16, H = 4096, V = 151936, T = 0.7, N = 8192 and 32768) -> OUT/policy.json, policy.md;
#   3. policy_loss_bench.py: the triton backend's memory choices and a smaller chunk (PLB_IMPLS
#      sets the list), determinism -> OUT/plb/policy_loss_bench.json;
#   4. fusedhead check {triton,torch} --device cuda --dtype {bf16,fp16} -k policy -> OUT/checks.log;
#   5. policy_host_profile.py fused:triton 8192: the host's Python time in one step (what an idle
#      GPU waits for) -> OUT/host_profile.log.
# Limits (s): BENCH_LIMIT 300 (BENCH_MINUTES 4 of bench time cap), PLB_LIMIT 120, CHECK_LIMIT 90,
# HOST_LIMIT 60; PLB_LIMIT=0 skips step 3. BENCH_IMPLS sets step 2's list. Every step runs; each
# log ends "NAME exit N" and the exit status is 1 when any step failed.
set -uo pipefail
OUT=${1:?usage: policy_loss.sh OUT [PARTS_DIR ...]}
shift
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env "$@" || exit 1
tail -n 6 "$OUT/setup.log"
timeout -k 10 "${BENCH_LIMIT:-300}" python3 -m fusedhead.cli bench --device cuda --dtype bf16 \
  --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 --case policy \
  --max-minutes "${BENCH_MINUTES:-4}" --impl ${BENCH_IMPLS:-triton unfused:triton liger-direct torch unfused:torch} \
  --json "$OUT/policy.json" --markdown "$OUT/policy.md" >"$OUT/bench.log" 2>&1
record bench $? >>"$OUT/bench.log"
tail -n 14 "$OUT/bench.log"
if [[ ${PLB_LIMIT:-120} == 0 ]]; then
  echo "policy_loss_bench skipped (PLB_LIMIT=0)" >"$OUT/plb.log"
else
  timeout -k 10 "${PLB_LIMIT:-120}" python3 "$HERE/policy_loss_bench.py" "$OUT/plb" --reps 5 --accuracy-n 8192 \
    --impl ${PLB_IMPLS:-fused:triton fused:triton:memory=fast fused:triton:policy_chunk_rows=1536 unfused:triton} \
    >"$OUT/plb.log" 2>&1
  record policy_loss_bench $? >>"$OUT/plb.log"
fi
tail -n 10 "$OUT/plb.log"
for b in triton torch; do
  for dt in bf16 fp16; do
    timeout -k 10 "${CHECK_LIMIT:-90}" python3 -m fusedhead.cli check "$b" --device cuda --dtype $dt -k policy
    record "check $b $dt" $?
  done
done >"$OUT/checks.log" 2>&1
tail -n 20 "$OUT/checks.log"
timeout -k 10 "${HOST_LIMIT:-60}" python3 "$HERE/policy_host_profile.py" fused:triton 8192 \
  >"$OUT/host_profile.log" 2>&1
record "host profile" $? >>"$OUT/host_profile.log"
head -n 3 "$OUT/host_profile.log"
finish
