#!/usr/bin/env bash
# trainers_outputs.sh [OUT]: one GPU call for the trainer integration, the torch backend's logits
# precision and the distillation outputs, from the repository root on any CUDA machine with
# torch and triton, with .gpu-wheels/{small,install-wheels} (pydantic, hatchling: made by
# shared/gpu/prepare-wheels) and .whl/trl-1.16.0-*.whl carried (TRL is installed --no-deps: the
# bench loads its kernel file alone). Outputs in $OUT (or the folder given), at most 8 files:
#   setup.log, logits_precision.json (+.log), trl_grpo_bench.json (+.log), heads.json, pytest.log
set -uo pipefail
OUT=${1:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # run LIMIT_S LOG CMD...
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend
  python3 -m pip install -q --no-index --no-deps .whl/trl-*.whl
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
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
