#!/usr/bin/env bash
# issue32.sh OUT [BASE]: issue 32's H200 checks in one call (one install), from the root of the
# tree to check, on any CUDA machine with torch and triton. BASE: a checkout of the tree before
# issue 32 (e.g. `git archive fc43871`), installed beside it into a --target folder. This tree is
# installed by scripts/gpu/setup_tree.sh --liger (from pip's index, or from a carried
# .gpu-wheels/{small,install-wheels} on a machine without one, such as the one lent here; the
# script stops with status 1 when that fails), BASE the same way with --no-deps.
#   overhead   scripts/core_overhead.py on the GPU host's CPU (the core's own cost per call over
#              the torch backend; bound: 20 us, and no slower than BASE), this tree's and BASE's
#              runs taking turns, over the torch backend and alone (null); OUT/overhead.jsonl
#              (a "tree" key: this or base).
#   triton     pytest -m gpu tests/triton_backend: the kernels imported by name in launch.py, kl.py
#              and topk.py, the custom-op pairs registered by custom_ops.register_pair (fakes,
#              autograd, double backward refused, torch.compile fullgraph) on real CUDA.
#   core       pytest -m gpu tests/core tests/outputs tests/policy: the request path and the
#              deferred value checks (value_checks.Pending's CUDA read) on CUDA.
# Limits: OVERHEAD_ROUNDS (3), TRITON_LIMIT (150 s), CORE_LIMIT (60 s). Every step runs; the exit
# status is 1 when any failed (BASE's install, an overhead run, a pytest step).
set -uo pipefail
OUT=${1:?usage: issue32.sh OUT [BASE]}
BASE=${2:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
: >"$OUT/setup.log"
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env || exit 1
run() { # run NAME LIMIT CMD...: CMD's output in OUT/NAME.log, "NAME exit N" at its end
  local name=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  record "$name" $? >>"$OUT/$name.log"
  tail -n 12 "$OUT/$name.log"
}
: >"$OUT/overhead.jsonl"
if [[ -n $BASE ]]; then
  base_pip=(--no-deps) # its dependencies: this tree's, installed above
  [[ $SETUP_TREE_MODE == wheels ]] && base_pip+=(--no-index --no-build-isolation)
  python3 -m pip install -q "${base_pip[@]}" --target "$OUT/.base-site" \
    "$BASE/core" "$BASE/plugins/torch_backend" >>"$OUT/setup.log" 2>&1
  record "install BASE" $? >>"$OUT/setup.log"
  tail -n 1 "$OUT/setup.log"
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
    overhead this --backend "$backend" || record "overhead this --backend $backend" $?
    if [[ -n $BASE ]]; then
      overhead base --backend "$backend" || record "overhead base --backend $backend" $?
    fi
  done
done
rm -rf "$OUT/.base-site"
cat "$OUT/overhead.jsonl"
run triton "${TRITON_LIMIT:-150}" python3 -m pytest -m gpu tests/triton_backend -q -rfEs \
  -p no:cacheprovider -k "${PYTEST_K:-not kit_property or bf16}"
run core "${CORE_LIMIT:-60}" python3 -m pytest -m gpu tests/core tests/outputs tests/policy -q \
  -rfEs -p no:cacheprovider
finish
