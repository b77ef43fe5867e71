#!/usr/bin/env bash
# ab.sh: an A/B of committed source trees on one GPU, each tree in its own processes, in turn.
#   ab.sh pack REV...             here, from the repository root: each commit's tree as
#                                 $AB_DIR/ab-<short>.tgz (AB_DIR: .gpu-tmp, git-ignored; carry it)
#   ab.sh run OUT [ROUNDS] [CASES]  there, from the repository root on any CUDA machine: every
#                                 packed tree unpacked under AB_ROOT (default: a fresh mktemp -d,
#                                 removed after), then scripts/gpu/ab_cases.py in each tree in
#                                 turn, ROUNDS rounds (default 2), one process a tree a round:
#                                 OUT/ab.jsonl (stderr in OUT/ab.err)
# Each run puts its tree's sources first on PYTHONPATH; the installed fusedhead only lends its
# entry points and dependencies. When fusedhead or pydantic does not import, the first packed tree
# is installed by scripts/gpu/setup_tree.sh --tree (from pip's index, or from a carried
# .gpu-wheels/{small,install-wheels} on a machine without one, such as the one lent here) into
# OUT/setup.log; if that fails, `run` stops with status 1. `run` exits 1 when any tree's run failed.
# AB_N="8192 32768" sets the token counts (ab_cases.py --n), AB_BACKEND the backend (--backend),
# AB_LIMIT (150 s) each process's limit. AB_DRY=1 rehearses `run` on a CPU (the torch backend, tiny
# shapes); PYTHON picks the Python.
set -uo pipefail
AB_DIR=${AB_DIR:-.gpu-tmp}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case ${1:-} in
pack)
  shift
  mkdir -p "$AB_DIR"
  rm -f "$AB_DIR"/ab-*.tgz
  for rev in "$@"; do
    short=$(git rev-parse --short "$rev") || exit 2
    git archive "$short" | gzip >"$AB_DIR/ab-$short.tgz" || { echo "ab.sh: git archive $short failed" >&2; exit 1; }
    echo "packed $rev as $AB_DIR/ab-$short.tgz"
  done
  ;;
run)
  OUT=${2:?usage: ab.sh run OUT [ROUNDS] [CASES]}
  ROUNDS=${3:-2} CASES=${4:-}
  if [[ -n ${AB_ROOT:-} ]]; then
    root=$AB_ROOT
  else
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
  fi
  mkdir -p "$OUT"
  trees=()
  for tgz in "$AB_DIR"/ab-*.tgz; do
    [[ -e $tgz ]] || { echo "ab.sh: no $AB_DIR/ab-*.tgz: run 'ab.sh pack REV...' first" >&2; exit 2; }
    name=$(basename "$tgz" .tgz)
    name=${name#ab-}
    rm -rf "${root:?}/$name" && mkdir -p "$root/$name" && tar xzf "$tgz" -C "$root/$name" ||
      { echo "ab.sh: cannot unpack $tgz" >&2; exit 1; }
    trees+=("$name")
  done
  if ! "$PY" -c "import fusedhead, pydantic" 2>/dev/null; then # entry points: from any one tree
    SETUP_PYTHON=$PY source "$HERE/setup_tree.sh" "$OUT/setup.log" --tree "$root/${trees[0]}" || exit 1
  fi
  export PYTHONUNBUFFERED=1
  failed=0
  for ((r = 1; r <= ROUNDS; r++)); do
    for t in "${trees[@]}"; do
      src=$root/$t
      PYTHONPATH=$src/core/src:$src/plugins/triton_backend/src:$src/plugins/torch_backend/src \
        timeout "${AB_LIMIT:-150}" "$PY" "$HERE/ab_cases.py" "$t" ${CASES:+--cases "$CASES"} ${AB_N:+--n $AB_N} ${AB_BACKEND:+--backend $AB_BACKEND} \
        ${AB_DRY:+--dry} 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl"
      rc=$?
      if ((rc != 0)); then
        echo "ab.sh: tree $t, round $r: exit $rc (OUT/ab.err)" >&2
        failed=1
      fi
    done
  done
  exit "$failed"
  ;;
*)
  echo "usage: ab.sh pack REV... | ab.sh run OUT [ROUNDS] [CASES]" >&2
  exit 2
  ;;
esac
