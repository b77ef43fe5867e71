#!/usr/bin/env bash
# ab.sh: an A/B of committed source trees on one GPU, each tree in its own processes, in turn.
#   ab.sh pack REV...             here, from the repository root: each commit's tree as
#                                 $AB_DIR/ab-<short>.tgz (AB_DIR: .gpu-tmp, git-ignored; carry it,
#                                 .gpu-wheels/small and .gpu-wheels/install-wheels)
#   ab.sh run OUT [ROUNDS] [CASES]  there: every packed tree unpacked under $AB_ROOT, then
#                                 scripts/gpu/ab_cases.py in each tree in turn, ROUNDS rounds
#                                 (default 2), one process a tree a round: OUT/ab.jsonl
# AB_N="8192 32768" sets the token counts (ab_cases.py --n), AB_BACKEND the backend (--backend). AB_DRY=1 rehearses `run` on a CPU (the torch backend, tiny shapes); PYTHON picks the Python.
set -uo pipefail
AB_DIR=${AB_DIR:-.gpu-tmp}
PY=${PYTHON:-python3}
case ${1:-} in
pack)
  shift
  mkdir -p "$AB_DIR"
  rm -f "$AB_DIR"/ab-*.tgz
  for rev in "$@"; do
    short=$(git rev-parse --short "$rev") || exit 2
    git archive "$short" | gzip >"$AB_DIR/ab-$short.tgz"
    echo "packed $rev as $AB_DIR/ab-$short.tgz"
  done
  ;;
run)
  OUT=${2:?usage: ab.sh run OUT [ROUNDS] [CASES]}
  ROUNDS=${3:-2} CASES=${4:-}
  root=${AB_ROOT:-/tmp/fusedhead-ab}
  mkdir -p "$OUT"
  trees=()
  for tgz in "$AB_DIR"/ab-*.tgz; do
    [[ -e $tgz ]] || { echo "ab.sh: no $AB_DIR/ab-*.tgz: run 'ab.sh pack REV...' first" >&2; exit 2; }
    name=$(basename "$tgz" .tgz)
    name=${name#ab-}
    rm -rf "${root:?}/$name" && mkdir -p "$root/$name" && tar xzf "$tgz" -C "$root/$name"
    trees+=("$name")
  done
  if ! "$PY" -c "import fusedhead, pydantic" 2>/dev/null; then # entry points: from any one tree
    {
      bash .gpu-wheels/install-wheels .gpu-wheels/small
      (cd "$root/${trees[0]}" && "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation ./core ./plugins/torch_backend ./plugins/triton_backend)
    } >>"$OUT/setup.log" 2>&1
  fi
  export PYTHONUNBUFFERED=1
  for ((r = 1; r <= ROUNDS; r++)); do
    for t in "${trees[@]}"; do
      src=$root/$t
      PYTHONPATH=$src/core/src:$src/plugins/triton_backend/src:$src/plugins/torch_backend/src \
        timeout "${AB_LIMIT:-150}" "$PY" scripts/gpu/ab_cases.py "$t" ${CASES:+--cases "$CASES"} ${AB_N:+--n $AB_N} ${AB_BACKEND:+--backend $AB_BACKEND} \
        ${AB_DRY:+--dry} 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
    done
  done
  ;;
*)
  echo "usage: ab.sh pack REV... | ab.sh run OUT [ROUNDS] [CASES]" >&2
  exit 2
  ;;
esac
