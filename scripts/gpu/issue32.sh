#!/usr/bin/env bash
# issue32.sh OUT: issue 32's H200 checks in one call (one install), from the repository root with
# .gpu-wheels/{small,install-wheels} carried:
#   overhead   scripts/core_overhead.py five times on the GPU host's CPU (the core's own cost per
#              call over the torch backend; bound: 20 us), JSON lines in OUT/overhead.jsonl.
#   triton     pytest -m gpu tests/triton_backend: the kernels imported by name in launch.py, kl.py
#              and topk.py, the custom-op pairs registered by custom_ops.register_pair (fakes,
#              autograd, double backward refused, torch.compile fullgraph) on real CUDA.
#   core       pytest -m gpu tests/core tests/outputs tests/policy: the request path and the
#              deferred value checks (value_checks.Pending's CUDA read) on CUDA.
set -uo pipefail
OUT=${1:?usage: issue32.sh OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
{
  bash .gpu-wheels/install-wheels .gpu-wheels/small
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ./core \
    ./plugins/torch_backend ./plugins/triton_backend ./plugins/liger_backend
  python3 "$HERE/env_report.py"
} >"$OUT/setup.log" 2>&1
run() { # run NAME LIMIT CMD...
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name exit $?" >>"$OUT/$name.log"
  tail -n 12 "$OUT/$name.log"
}
: >"$OUT/overhead.jsonl"
for i in 1 2 3 4 5; do
  timeout 40 python3 scripts/core_overhead.py --json >>"$OUT/overhead.jsonl" 2>>"$OUT/overhead.err"
done
cat "$OUT/overhead.jsonl"
run triton "${TRITON_LIMIT:-150}" python3 -m pytest -m gpu tests/triton_backend -q -rfEs \
  -p no:cacheprovider -k "${PYTEST_K:-not kit_property or bf16}"
run core "${CORE_LIMIT:-60}" python3 -m pytest -m gpu tests/core tests/outputs tests/policy -q \
  -rfEs -p no:cacheprovider
