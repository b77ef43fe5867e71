#!/usr/bin/env bash
# run_all.sh [--out OUT] [PARTS_DIR ...]: the one GPU call that measures everything, on one H200.
#
# Run from the repository root on any CUDA machine with Python, torch and triton (and a package
# index, or ${WHEELS:-.gpu-wheels}/install-wheels with its small/ folder carried where there is
# none, as on the machine lent to this project: scripts/gpu/setup_tree.sh says how each is used).
# PARTS_DIR (only for the carried wheels) are folders holding the pieces (NAME.whl.part-aa,
# NAME.whl.part-ab, ...) of the CuTe DSL runtime wheel that Liger's SM90 kernel needs; pieces from
# several folders are joined (one may have been stashed on the machine by scripts/gpu/stash_part.sh
# in an earlier call). Without complete pieces everything still runs and the Liger native kernel is
# reported unavailable.
#
# Steps, each with its own time limit and failing on its own (statuses in summary.txt), all
# within DEADLINE_S of the start:
#   install       scripts/gpu/setup_tree.sh --liger: the project (core + the three backends) and
#                 the check that this tree is what imports (without "install" in STEPS: that
#                 check alone, "verify"); when it fails, every later step but env is skipped
#   env, list     versions and `fusedhead list --check --device cuda`
#   bench         fusedhead bench, N=8192 and 32768, H=4096, V=151936, bf16, T=0.7: liger,
#                 liger-direct, torch, verl-chunked, cce, reference (skipped where it would not fit
#                 or is not installed)
#   bench-last    triton, in a second process appending to the same JSON
#   bench-report  the table and plot of the whole JSON
#   check-*       fusedhead check {triton,liger,torch} --device cuda --dtype bf16, in parallel with
#   pytest-gpu    pytest -m gpu over tests/ (nothing of these four is timed)
#   *-gpu-check   plugins/{liger,triton}_backend/tools/gpu_check.py when present, one at a time
# Exit status 1 when a step failed or ran out of its time (a step skipped for lack of time is only
# noted), else 0. Results in OUT (--out, else $OUT, else ./.gpu-out), at most 8 files (anything
# more is packed into extra.tar.gz): summary.txt, bench.json, bench.md, bench.png, bench.log,
# checks.log, liger_gpu_check.json, triton_gpu_check.json.
#
# Knobs (environment): DEADLINE_S (570), STEPS ("install bench checks tools": the groups to run),
# INSTALL_LIMIT (300 s), BENCH_MINUTES (2.5) and BENCH_IMPLS (first bench process),
# BENCH_LAST_MINUTES (1.2) and BENCH_LAST_IMPLS (triton; empty: no second process), BENCH_SHAPE,
# DEVICE (cuda), DTYPE (bf16), LIGER_CHECK_ARGS, TRITON_CHECK_ARGS, TRITON_CHECK_LIMIT (150 s),
# CHECKS_LIMIT (240 s: each of the four parallel checks; pytest -m gpu alone took 207 s on an
# H200), WHEELS (.gpu-wheels). DEVICE=cpu DTYPE=fp32 with a tiny BENCH_SHAPE rehearses the whole
# script on a CPU (tests/bench/test_gpu_script.py does, with pip and nvidia-smi stubbed).
set -uo pipefail
# The tree's commit, stamped here before the call (scripts/gpu/stamp.sh; carry .gpu-stamp):
# the machine's copy of .git can be older than the files it received.
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)

START=$SECONDS
DEADLINE_S=${DEADLINE_S:-570}
RESERVE_S=15
if [[ ${1:-} == --out ]]; then
  OUT=${2:?usage: run_all.sh [--out OUT] [PARTS_DIR ...]}
  shift 2
fi
OUT=${OUT:-$PWD/.gpu-out}
WHEELS=${WHEELS:-.gpu-wheels}
BENCH_MINUTES=${BENCH_MINUTES:-2.5}
BENCH_IMPLS=${BENCH_IMPLS:-liger liger-direct torch verl-chunked cce reference}
BENCH_LAST_MINUTES=${BENCH_LAST_MINUTES:-1.2}
BENCH_LAST_IMPLS=${BENCH_LAST_IMPLS-triton}
BENCH_SHAPE=${BENCH_SHAPE:---n 8192 32768 --hidden 4096 --vocab 151936}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
LIGER_CHECK_ARGS=${LIGER_CHECK_ARGS:-}
TRITON_CHECK_ARGS=${TRITON_CHECK_ARGS:---quick --budget-s 45}
CHECKS_LIMIT=${CHECKS_LIMIT:-240}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

STEPS=${STEPS:-install bench checks tools}
want() { [[ " $STEPS " == *" $1 "* ]]; }

mkdir -p "$OUT"
rm -f "$OUT/bench.json"  # bench appends: start from nothing
WORK=$(mktemp -d)
FAILED=$WORK/failed # one line a failed step (steps in the background too)
: >"$FAILED"
SUMMARY=$OUT/summary.txt
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE_S - (SECONDS - START) - RESERVE_S)); }

# step NAME LOG LIMIT_S CMD...: run CMD with its output appended to LOG, limited to LIMIT_S seconds
# (or what is left of the whole run); record exit status and time, and a failure in $FAILED. Never
# stops the script; returns 0 (ok), 1 (failed or timed out) or 2 (skipped: no time left).
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  local t
  t=$(left)
  ((t < limit)) && limit=$t
  if ((limit < 10)); then
    note "$(printf '%-18s %-10s %5ss  %s' "$name" "skipped" 0 "no time left")"
    return 2
  fi
  local t0=$SECONDS
  {
    local shown="${*//$PWD\//}" # logs that get committed name no path of the machine
    shown="${shown//$OUT/\$OUT}"
    shown="${shown//$WORK/\$WORK}"
    echo "===== $name: $shown (limit ${limit}s) ====="
    timeout -k 10 "$limit" "$@"
  } >>"$log" 2>&1
  local rc=$?
  local status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status="exit $rc"
  echo "===== $name: $status after $((SECONDS - t0))s =====" >>"$log"
  note "$(printf '%-18s %-10s %5ss  %s' "$name" "$status" $((SECONDS - t0)) "${SHOWN_LOG:-$(basename "$log")}")"
  if ((rc != 0)); then
    echo "$name ($status)" >>"$FAILED"
    return 1
  fi
  return 0
}

note "fusedhead GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
note "$(nvidia-smi -L 2>&1 | head -4)"
note "step               status      time  log"

# --- install -------------------------------------------------------------------------------------
SETUP=$WORK/setup.log
PARTS=$WORK/parts
: >"$SETUP"
# One setup path (scripts/gpu/setup_tree.sh): the carried wheels where they are, else pip's index.
# The measuring steps run only on this tree's install: an earlier tree's fusedhead left on the
# machine would otherwise be measured under this tree's name.
INSTALLED=1
if want install; then
  parts=()
  if [[ -f $WHEELS/install-wheels ]]; then
    bash "$HERE/join_parts.sh" "$PARTS" "$@" >>"$SETUP" 2>&1
    if [[ -n $(ls -A "$PARTS" 2>/dev/null) ]]; then
      parts=("$PARTS")
    else
      note "no complete CuTe DSL wheel pieces: Liger's native kernel will be unavailable"
    fi
  elif (($#)); then
    note "no $WHEELS/install-wheels: the CuTe DSL comes from the index, PARTS_DIRs are not used"
  fi
  step install "$SETUP" "${INSTALL_LIMIT:-300}" bash "$HERE/setup_tree.sh" - --liger \
    ${parts[@]+"${parts[@]}"} || INSTALLED=0
else
  step verify "$SETUP" 60 python3 "$HERE/tree_installed.py" . || INSTALLED=0
fi
step env "$SETUP" 60 python3 "$HERE/env_report.py"
if ((!INSTALLED)); then
  note "the install failed or this tree is not what imports (setup log below): list, bench, checks and tools skipped"
  STEPS=""
fi
((INSTALLED)) && step list "$SETUP" 60 python3 -m fusedhead.cli list --check --device "$DEVICE"

# --- bench (alone on the GPU: it times) ----------------------------------------------------------
# Two processes appending to one JSON: the Triton backend's own kernels run last and apart, so a
# crash or a hang there (a sticky CUDA error poisons a process) costs nobody else's numbers.
bench() { # bench NAME MINUTES IMPLS...
  local name=$1 minutes=$2
  shift 2
  local limit
  limit=$(python3 -c "print(int(${minutes} * 60 + 60))" 2>/dev/null || echo 210)
  step "$name" "$OUT/bench.log" "$limit" python3 -m fusedhead.cli bench --device "$DEVICE" \
    --dtype "$DTYPE" $BENCH_SHAPE --temperature 0.7 --impl "$@" --max-minutes "$minutes" \
    --append --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png"
}
if want bench; then
  # shellcheck disable=SC2086
  bench bench "$BENCH_MINUTES" $BENCH_IMPLS
  # shellcheck disable=SC2086
  [[ -n $BENCH_LAST_IMPLS ]] && bench bench-last "$BENCH_LAST_MINUTES" $BENCH_LAST_IMPLS
  # The table and plot of everything in bench.json, whichever process got how far.
  [[ -f $OUT/bench.json ]] && step bench-report "$OUT/bench.log" 60 python3 -m fusedhead.cli \
    bench --report-only --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png"
fi

# --- correctness, in parallel (nothing here is timed) -------------------------------------------
CHECKS=$OUT/checks.log
par() { # par NAME LIMIT CMD...: a step in the background with its own log
  local name=$1 limit=$2
  shift 2
  (SHOWN_LOG=checks.log step "$name" "$WORK/$name.log" "$limit" "$@") &
}
if want checks; then
  par check-triton "$CHECKS_LIMIT" python3 -m fusedhead.cli check triton --device "$DEVICE" --dtype "$DTYPE"
  par check-liger "$CHECKS_LIMIT" python3 -m fusedhead.cli check liger --device "$DEVICE" --dtype "$DTYPE"
  par check-torch "$CHECKS_LIMIT" python3 -m fusedhead.cli check torch --device "$DEVICE" --dtype "$DTYPE"
  par pytest-gpu "$CHECKS_LIMIT" python3 -m pytest -m gpu tests -q -rfEs -p no:cacheprovider \
    --continue-on-collection-errors
  wait
  for name in check-triton check-liger check-torch pytest-gpu; do
    [[ -f $WORK/$name.log ]] && cat "$WORK/$name.log" >>"$CHECKS"
  done
fi

# --- the backends' own GPU checks (one at a time: they time) ------------------------------------
if want tools && [[ -f plugins/liger_backend/tools/gpu_check.py ]]; then
  # shellcheck disable=SC2086
  step liger-gpu-check "$CHECKS" 120 python3 plugins/liger_backend/tools/gpu_check.py \
    "$OUT/liger_gpu_check.json" $LIGER_CHECK_ARGS
fi
if want tools && [[ -f plugins/triton_backend/tools/gpu_check.py ]]; then
  mkdir -p "$WORK/triton"
  # shellcheck disable=SC2086
  step triton-gpu-check "$CHECKS" "${TRITON_CHECK_LIMIT:-150}" python3 plugins/triton_backend/tools/gpu_check.py \
    --out "$WORK/triton" $TRITON_CHECK_ARGS
  [[ -f $WORK/triton/gpu_check.json ]] && mv "$WORK/triton/gpu_check.json" "$OUT/triton_gpu_check.json"
  if [[ -n $(ls -A "$WORK/triton") ]]; then
    mkdir -p "$OUT/extra" && cp -r "$WORK/triton" "$OUT/extra/triton"
  fi
fi

# --- summary and packing -------------------------------------------------------------------------
[[ -s $FAILED ]] && note "failed: $(paste -sd, "$FAILED" | sed 's/,/, /g')"
note "total $((SECONDS - START))s"
{
  echo
  echo "----- setup log -----"
  cat "$SETUP"
  for f in "$OUT/bench.log" "$CHECKS"; do
    [[ -f $f ]] || continue
    echo
    echo "----- last lines of $(basename "$f") -----"
    tail -n 40 "$f"
  done
} >>"$SUMMARY"
python3 "$HERE/pack_out.py" "$OUT" 8 summary.txt bench.json bench.md bench.png bench.log checks.log \
  triton_gpu_check.json liger_gpu_check.json || { ls -la "$OUT"; echo "pack_out" >>"$FAILED"; }
echo "----- summary (full: summary.txt) -----"
sed -n '/^step /,/^total /p' "$SUMMARY"
[[ -f $OUT/bench.md ]] && cat "$OUT/bench.md"
if [[ -s $FAILED ]]; then
  echo "run_all.sh: failed: $(paste -sd, "$FAILED" | sed 's/,/, /g')" >&2
  rm -rf "$WORK"
  exit 1
fi
rm -rf "$WORK"
exit 0
