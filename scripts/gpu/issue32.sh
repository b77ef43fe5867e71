#!/usr/bin/env bash
# issue32.sh OUT [BASE]: issue 32's H200 checks in one call (one install), from the root of the
# tree to check, with .gpu-wheels/{small,install-wheels} carried. BASE: a checkout of the tree
# before issue 32 (e.g. `git archive fc43871`), installed beside it into a --target folder.
#   overhead   scripts/core_overhead.py on the GPU host's CPU (the core's own cost per call over
#              the torch backend; bound: 20 us, and no slower than BASE), this tree's and BASE's
#              runs taking turns, over the torch backend and alone (null); OUT/overhead.jsonl
#              (a "tree" key: this or base).
#   triton     pytest -m gpu tests/triton_backend: the kernels imported by name in launch.py, kl.py
#              and topk.py, the custom-op pairs registered by custom_ops.register_pair (fakes,
#              autograd, double backward refused, torch.compile fullgraph) on real CUDA.
#   core       pytest -m gpu tests/core tests/outputs tests/policy: the request path and the
#              deferred value checks (value_checks.Pending's CUDA read) on CUDA.
# Limits: OVERHEAD_ROUNDS (3), TRITON_LIMIT (150 s), CORE_LIMIT (60 s).
set -uo pipefail
OUT=${1:?usage: issue32.sh OUT [BASE]}
BASE=${2:-}
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
if [[ -n $BASE ]]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$OUT/.base-site" \
    "$BASE/core" "$BASE/plugins/torch_backend" >>"$OUT/setup.log" 2>&1
fi
overhead() { # overhead TREE ARGS...: one JSON line, tagged with the tree
  local tree=$1
  shift
  {
    if [[ $tree == base ]]; then
      PYTHONPATH="$OUT/.base-site" timeout 40 python3 "$BASE/scripts/core_overhead.py" --json "$@"
    else
      timeout 40 python3 scripts/core_overhead.py --json "$@"
    fi
  } 2>>"$OUT/overhead.err" | sed "s/^{/{\"tree\": \"$tree\", /" >>"$OUT/overhead.jsonl"
}
for i in $(seq "${OVERHEAD_ROUNDS:-3}"); do
  for backend in torch null; do
    overhead this --backend "$backend"
    [[ -n $BASE ]] && overhead base --backend "$backend"
  done
done
rm -rf "$OUT/.base-site"
cat "$OUT/overhead.jsonl"
run triton "${TRITON_LIMIT:-150}" python3 -m pytest -m gpu tests/triton_backend -q -rfEs \
  -p no:cacheprovider -k "${PYTEST_K:-not kit_property or bf16}"
run core "${CORE_LIMIT:-60}" python3 -m pytest -m gpu tests/core tests/outputs tests/policy -q \
  -rfEs -p no:cacheprovider
