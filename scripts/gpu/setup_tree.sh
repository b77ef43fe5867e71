#!/usr/bin/env bash
# setup_tree.sh LOG [--liger] [--trl] [--env] [--tree DIR] [PARTS_DIR ...]: install a fusedhead
# tree (TREE: --tree, else the repository root this runs from) into the python3 on PATH, then check
# that it is what imports. The core and the torch and triton backends; --liger adds the liger
# backend, --trl adds TRL without its dependencies (the benches load its kernel file alone), --env
# runs scripts/gpu/env_report.py after. Two ways, chosen by what is there:
#   carried wheels  ${WHEELS:-.gpu-wheels}/install-wheels exists (a machine with no package index,
#                   such as the one lent to this project; the folder is git-ignored and made
#                   outside the repository): install-wheels installs $WHEELS/small (with the CuTe
#                   DSL wheel joined from the pieces in PARTS_DIRs, or without it when that
#                   install fails), then pip --no-index --no-deps --no-build-isolation the tree's
#                   folders; TRL from .whl/trl-*.whl.
#   package index   anywhere else: pip install the tree's folders with their dependencies from
#                   pip's configured index (the core with its testing and bench extras, the liger
#                   backend with sm90: the CuTe DSL), the installed torch and triton held by a
#                   constraint (nothing pulls another torch: install the machine's CUDA torch
#                   first); TRL as trl==1.16.0 (TRL_SPEC) --no-deps. PARTS_DIRs are not needed.
# Then scripts/gpu/tree_installed.py: fusedhead, fusedhead_torch and fusedhead_triton (and
# fusedhead_liger) import from TREE's folders as installed. Output appended to LOG ("-": stdout).
# On failure the reason and LOG's last lines go to stderr and the status is 1: a GPU script sources
# it as `source scripts/gpu/setup_tree.sh LOG ... || exit 1`, and then also has PYTHONUNBUFFERED,
# PYTHONDONTWRITEBYTECODE and FUSEDHEAD_GIT_COMMIT (from .gpu-stamp: scripts/gpu/stamp.sh, so
# that every bench record names the tree) exported, and SETUP_TREE_MODE set to "wheels" or "index"
# (for a caller's own pip calls); `bash setup_tree.sh ...` exits with the status. SETUP_PYTHON
# (python3) names the Python to install into.
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)

# _setup_tree_install TMP TREE LIGER TRL ENV [PARTS_DIR ...]: the install and the check; on
# failure, _SETUP_TREE_WHY says why and the status is 1.
_setup_tree_install() {
  local tmp=$1 tree=$2 liger=$3 trl=$4 env=$5
  shift 5
  local here wheels=${WHEELS:-.gpu-wheels} py=${SETUP_PYTHON:-python3}
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  local projects=("$tree/core" "$tree/plugins/torch_backend" "$tree/plugins/triton_backend")
  if [[ -f $wheels/install-wheels ]]; then
    echo "setup_tree: carried wheels ($wheels/install-wheels), no package index"
    SETUP_TREE_MODE=wheels
    local parts=$tmp/parts
    mkdir -p "$parts"
    (($#)) && bash "$here/join_parts.sh" "$parts" "$@"
    if [[ -n $(ls -A "$parts") ]]; then
      if ! bash "$wheels/install-wheels" "$wheels/small" "$parts" ||
        ! "$py" -c "import pydantic, hatchling"; then
        echo "setup_tree: retrying the wheels without the CuTe DSL pieces"
        bash "$wheels/install-wheels" "$wheels/small" ||
          { _SETUP_TREE_WHY="$wheels/install-wheels $wheels/small failed"; return 1; }
      fi
    else
      (($#)) && echo "setup_tree: no complete CuTe DSL wheel pieces: Liger's native kernel will be unavailable"
      bash "$wheels/install-wheels" "$wheels/small" ||
        { _SETUP_TREE_WHY="$wheels/install-wheels $wheels/small failed"; return 1; }
    fi
    ((liger)) && projects+=("$tree/plugins/liger_backend")
    echo "+ pip install --no-index --no-deps --no-build-isolation ${projects[*]}"
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation "${projects[@]}" ||
      { _SETUP_TREE_WHY="pip install --no-index of the tree failed"; return 1; }
    if ((trl)); then
      local whl=(.whl/trl-*.whl)
      ((${#whl[@]})) && [[ -e ${whl[0]} ]] ||
        { _SETUP_TREE_WHY="no .whl/trl-*.whl carried (TRL's wheel, for a machine without an index)"; return 1; }
      "$py" -m pip install -q --no-index --no-deps "${whl[@]}" ||
        { _SETUP_TREE_WHY="pip install --no-index of ${whl[*]} failed"; return 1; }
    fi
  else
    echo "setup_tree: no $wheels/install-wheels: installing from pip's index, this machine's torch kept"
    SETUP_TREE_MODE=index
    (($#)) && echo "setup_tree: PARTS_DIRs not used: the CuTe DSL comes from the index (liger's sm90 extra)"
    # torch (and the triton it was built with) as installed: a constraint, so that no dependency
    # resolution replaces them (a CPU or other-CUDA torch from the index would measure nothing).
    "$py" - "$tmp/constraints.txt" <<'PY' ||
import importlib.metadata as md
import sys

pins = []
for name in ("torch", "triton"):
    try:
        pins.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        if name == "torch":
            sys.exit("torch is not installed: install this machine's CUDA build of torch first "
                     "(setup_tree.sh never installs one)")
open(sys.argv[1], "w").write("".join(p + "\n" for p in pins))
print("setup_tree: held", " ".join(pins))
PY
      { _SETUP_TREE_WHY="no torch to keep (see above)"; return 1; }
    projects[0]="$tree/core[testing,bench]"
    ((liger)) && projects+=("$tree/plugins/liger_backend[sm90]")
    echo "+ pip install -c constraints.txt ${projects[*]}"
    "$py" -m pip install -q -c "$tmp/constraints.txt" "${projects[@]}" ||
      { _SETUP_TREE_WHY="pip install of the tree from the index failed"; return 1; }
    if ((trl)); then
      "$py" -m pip install -q --no-deps "${TRL_SPEC:-trl==1.16.0}" ||
        { _SETUP_TREE_WHY="pip install --no-deps ${TRL_SPEC:-trl==1.16.0} failed"; return 1; }
    fi
  fi
  local check=("$tree")
  ((liger)) && check+=(--liger)
  "$py" "$here/tree_installed.py" "${check[@]}" ||
    { _SETUP_TREE_WHY="the fusedhead that imports is not this tree's install (tree_installed.py above)"; return 1; }
  if ((env)); then
    "$py" "$here/env_report.py" || echo "setup_tree: env_report.py failed (not fatal)"
  fi
  return 0
}

setup_tree() { # LOG [--liger] [--trl] [--env] [--tree DIR] [PARTS_DIR ...]
  local log=${1:-}
  if [[ -z $log ]]; then
    echo "usage: setup_tree.sh LOG [--liger] [--trl] [--env] [--tree DIR] [PARTS_DIR ...]" >&2
    return 2
  fi
  shift
  local liger=0 trl=0 env=0 tree=. parts=()
  while (($#)); do
    case $1 in
    --liger) liger=1 ;;
    --trl) trl=1 ;;
    --env) env=1 ;;
    --tree)
      tree=${2:-}
      [[ -n $tree ]] || { echo "setup_tree.sh: --tree needs a folder" >&2; return 2; }
      shift
      ;;
    *) parts+=("$1") ;;
    esac
    shift
  done
  local tmp rc
  tmp=$(mktemp -d)
  _SETUP_TREE_WHY=""
  if [[ $log == - ]]; then
    _setup_tree_install "$tmp" "$tree" "$liger" "$trl" "$env" ${parts[@]+"${parts[@]}"}
    rc=$?
  else
    _setup_tree_install "$tmp" "$tree" "$liger" "$trl" "$env" ${parts[@]+"${parts[@]}"} >>"$log" 2>&1
    rc=$?
  fi
  rm -rf "$tmp"
  if ((rc != 0)); then
    local why="setup_tree: FAILED: ${_SETUP_TREE_WHY:-exit $rc}"
    if [[ $log != - ]]; then
      echo "$why" >>"$log"
      echo "----- last lines of the setup log, $(basename "$log") -----" >&2
      tail -n "${SETUP_TAIL:-25}" "$log" >&2
    fi
    echo "$why" >&2
    return 1
  fi
  echo "setup_tree: ok"
  return 0
}

setup_tree "$@"
