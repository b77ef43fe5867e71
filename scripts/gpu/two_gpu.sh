#!/usr/bin/env bash
# two_gpu.sh [OUT]: the issue-9 call on a machine with two GPUs (e.g. nvidia-h200-x2), from the repo
# root on any such CUDA machine with torch and triton. Installs this tree (scripts/gpu/setup_tree.sh
# --liger: from pip's index, or from a carried .gpu-wheels/{small,install-wheels} on a machine
# without one, such as the one lent here; stops with status 1 when that fails), runs the NCCL
# vocab-parallel comparison (scripts/gpu/vocab_parallel_nccl.py under torchrun), then the
# conformance kit on cuda for every backend that declares vocab-parallel (its vocab_parallel
# property uses NCCL on two GPUs), then, if time is left, `fusedhead bench` on GPU 0 (BENCH_IMPLS).
# Results in OUT (default $OUT, else ./.gpu-out): vocab_parallel_nccl.json, vp.log, checks.log, setup.log, bench.json, bench.log.
# Exit status 1 when any step failed ("NAME exit N" lines), else 0.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${1:-${OUT:-$PWD/.gpu-out}}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
BENCH_IMPLS=${BENCH_IMPLS:-triton torch}
mkdir -p "$OUT"
START=$SECONDS
DEADLINE_S=${DEADLINE_S:-560}
{
  nvidia-smi -L
  nvidia-smi topo -m
} >"$OUT/setup.log" 2>&1
# The tree, installed and checked; FUSEDHEAD_GIT_COMMIT from .gpu-stamp (scripts/gpu/stamp.sh;
# the machine's copy of .git can be older than the files it received) names it in every record.
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env || exit 1
python3 -m fusedhead.cli list --check --device cuda >>"$OUT/setup.log" 2>&1
record list $? >>"$OUT/setup.log"
echo "setup done after $((SECONDS - START))s"
timeout -k 10 300 torchrun --nproc-per-node 2 scripts/gpu/vocab_parallel_nccl.py \
  "$OUT/vocab_parallel_nccl.json" >"$OUT/vp.log" 2>&1
record vocab_parallel_nccl $?
echo "vocab_parallel_nccl done after $((SECONDS - START))s"
python3 - "$OUT/vocab_parallel_nccl.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    e = r.get("errors_vs_single_gpu", {})
    print(r["rank"], r["backend"], r.get("options"), r.get("layout"), r.get("reduce_hidden_grad"),
          "pass" if r.get("pass") else r.get("error") or r.get("reason") or "FAIL",
          " ".join(f"{k}={v:.1e}" for k, v in e.items()),
          "" if "fwd_bwd_units_local" not in r else
          f"units={r['fwd_bwd_units_local']:.2f} single={r['single_gpu_units']:.2f} "
          f"speedup={r['speedup_vs_single_gpu']:.2f} peak={r['peak_extra_gib']:.2f}GiB")
PY
for b in torch triton; do
  timeout -k 10 150 python3 -m fusedhead.cli check "$b" --device cuda --dtype bf16 -v \
    >>"$OUT/checks.log" 2>&1
  record "check $b" $?
done
timeout -k 10 150 python3 -m fusedhead.cli check liger --device cuda --dtype bf16 -v \
  --options '{"implementation": "fallback"}' >>"$OUT/checks.log" 2>&1
record "check liger fallback" $?
echo "checks done after $((SECONDS - START))s"
grep -E "vocab_parallel|pass|fail" "$OUT/checks.log" | tail -20
left=$((DEADLINE_S - (SECONDS - START)))
if [[ -n $BENCH_IMPLS ]] && ((left > 150)); then
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 $((left - 20)) python3 -m fusedhead.cli bench \
    --device cuda --dtype bf16 --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 \
    --impl $BENCH_IMPLS --max-minutes $(((left - 60) / 60)) --json "$OUT/bench.json" \
    >"$OUT/bench.log" 2>&1
  record bench $?
  echo "bench done after $((SECONDS - START))s"
  tail -n 12 "$OUT/bench.log"
fi
finish
