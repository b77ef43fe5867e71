#!/usr/bin/env bash
# issue33b.sh [OUT]: issue 33 part B on one H200, from the repository root, with .gpu-wheels/small
# and .gpu-wheels/install-wheels carried (shared/gpu/prepare-wheels makes them), in one call:
#   1. the wheels and the project installed as run_all.sh installs them (no index, no deps);
#   2. scripts/gpu/ignored_rows_check.py: NaN/+-inf in ignored rows for every output of triton
#      (bf16/fp16/fp32, memory low and fast), torch (bf16) and liger where it runs; double
#      backward refused naming create_graph, four ways -> OUT/ignored_rows.json;
#   3. the torch backend's time (issue 33: 6.92 GEMM units fwd+bwd at N = 8192 against 6.25 on
#      2026-12-01): fusedhead bench --impl torch with the default options, then with
#      fp32_logits false -> OUT/bench-torch*.json.
# About 4 minutes. Outputs in OUT (default $OUT, else ./.gpu-out).
set -uo pipefail
OUT=${1:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
timeout 150 python3 "$HERE/ignored_rows_check.py" "$OUT" >"$OUT/ignored_rows.log" 2>&1
echo "ignored_rows_check exit $?" >>"$OUT/ignored_rows.log"
BENCH=(python3 -m fusedhead.cli bench --device cuda --dtype bf16 --n 8192 --hidden 4096
  --vocab 151936 --temperature 0.7 --max-minutes 1 --no-accuracy --impl torch)
timeout 100 "${BENCH[@]}" --json "$OUT/bench-torch.json" >"$OUT/bench-torch.log" 2>&1
echo "bench exit $?" >>"$OUT/bench-torch.log"
BENCH[-1]='torch:{"fp32_logits": false}'  # --impl's value
timeout 100 "${BENCH[@]}" \
  --json "$OUT/bench-torch-bf16-logits.json" >"$OUT/bench-torch-bf16-logits.log" 2>&1
echo "bench exit $?" >>"$OUT/bench-torch-bf16-logits.log"
tail -n 30 "$OUT/ignored_rows.log"
tail -n 6 "$OUT/bench-torch.log" "$OUT/bench-torch-bf16-logits.log"
