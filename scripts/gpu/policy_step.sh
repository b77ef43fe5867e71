#!/usr/bin/env bash
# policy_step.sh [OUT]: issue 34's H200 figures, one call from the repository root, with
# .gpu-wheels/{small,install-wheels} and .whl/trl-1.16.0-*.whl carried (as trainers_outputs.sh).
# One GRPO policy step at a Qwen2-shaped head (N = 8192, H = 3584, V = 151936, bf16): TRL's kernel
# + the loss, fusedhead triton log-probs + the loss, fused_policy_loss. Outside TRL (its deps do
# not travel), the same loss. Outputs: setup.log, policy_step_bench.json, policy_step_bench.log.
set -uo pipefail
OUT=${1:-${OUT:-$PWD/.gpu-out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend
  python3 -m pip install -q --no-index --no-deps .whl/trl-*.whl
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
timeout -k 10 200 python3 "$HERE/policy_step_bench.py" "$OUT" >"$OUT/policy_step_bench.log" 2>&1
echo "exit $?" >>"$OUT/policy_step_bench.log"
tail -n 8 "$OUT/policy_step_bench.log"
