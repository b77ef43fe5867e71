#!/usr/bin/env bash
# policy_shapes.sh OUT: the policy loss beside the unfused path at model shapes other than the
# issue's (H, V pairs of small to large models, N = 2048 and 8192), bf16, one CUDA GPU, from the
# repository root on any CUDA machine with torch and triton; this tree is installed first by
# scripts/gpu/setup_tree.sh (from pip's index, or from a carried .gpu-wheels/{small,install-wheels}
# on a machine without one, such as the one lent here; status 1 when that fails). Every pair is
# one `fusedhead bench --case policy` run appended to OUT/shapes.json; OUT/shapes.md is the table.
# SHAPES_MINUTES caps the whole run (default 6; the pairs it leaves out are only noted). The exit
# status is 1 when a run or the table failed ("H=.. V=.. exit N").
set -uo pipefail
OUT=${1:?usage: policy_shapes.sh OUT}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" || exit 1
start=$(date +%s)
# (H, V): Qwen2.5-0.5B, Llama-3.2-1B, Qwen2.5-7B, Llama-3-8B, Llama-3-70B-like
for hv in "896 151936" "2048 128256" "3584 152064" "4096 128256" "8192 128256"; do
  set -- $hv
  left=$(( ${SHAPES_MINUTES:-6} * 60 - ($(date +%s) - start) ))
  (( left > 20 )) || { echo "skipped H=$1 V=$2: time"; continue; }
  timeout -k 5 "$left" python3 -m fusedhead.cli bench --device cuda --dtype bf16 --n 2048 8192 \
    --hidden "$1" --vocab "$2" --temperature 0.7 --case policy --impl triton unfused:triton \
    --json "$OUT/shapes.json" --append >>"$OUT/bench.log" 2>&1
  record "H=$1 V=$2" $?
done
python3 -m fusedhead.cli bench --report-only --json "$OUT/shapes.json" --markdown "$OUT/shapes.md"
record report $? >/dev/null
tail -n 14 "$OUT/shapes.md"
finish
