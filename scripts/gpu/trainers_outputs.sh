#!/usr/bin/env bash
# trainers_outputs.sh [OUT]: one GPU call for the trainer integration, the torch backend's logits
# precision and the distillation outputs, from the repository root on any CUDA machine with
# torch and triton. This tree and TRL 1.16.0 (--no-deps: the bench loads its kernel file alone)
# are installed by scripts/gpu/setup_tree.sh --trl: from pip's index, or, on a machine without one
# such as the one lent here, from a carried .gpu-wheels/{small,install-wheels} and
# .whl/trl-1.16.0-*.whl; the script stops with status 1 when that fails, and exits 1 when a step
# failed. Outputs in $OUT (or the folder given), at most 8 files:
#   setup.log, logits_precision.json (+.log), trl_grpo_bench.json (+.log), heads.json, pytest.log
set -uo pipefail
OUT=${1:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # run LIMIT_S LOG CMD...; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" --trl --env || exit 1
run 150 "$OUT/logits_precision.log" python3 plugins/torch_backend/tools/logits_precision.py "$OUT"
run 180 "$OUT/trl_grpo_bench.log" python3 "$HERE/trl_grpo_bench.py" "$OUT"
run 170 "$OUT/heads.log" python3 -m fusedhead.cli bench --device cuda --dtype bf16 --n 8192 \
  --hidden 4096 --vocab 151936 --temperature 0.7 --impl torch triton \
  --case logprobs topk32 gather32 kl kl-reverse --max-minutes 2 --json "$OUT/heads.json"
run 120 "$OUT/pytest.log" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
  tests/torch_backend tests/outputs
cat "$OUT/heads.log" >>"$OUT/pytest.log"  # keep the file count within 8
rm -f "$OUT/heads.log"
for f in "$OUT"/*.log; do echo "## $(basename "$f")"; grep -E "=====|PASS|FAIL|passed|failed|Error" "$f" | tail -n 8; done
finish
