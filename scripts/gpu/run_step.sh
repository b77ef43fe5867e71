#!/usr/bin/env bash
# run_step.sh: sourced by the GPU scripts. A failed step never stops a script (a step cut by its
# limit leaves the next ones to run, so that one call gathers everything), but it is remembered:
#   run LIMIT_S LOG CMD...  one step, its command line (the repository's path left out) and its
#                           output appended to LOG, "===== exit N after S s =====" after;
#   record NAME RC          prints "NAME exit RC" and remembers NAME as failed when RC is not 0
#                           (call it right after the command: `cmd; record NAME $?`);
#   finish                  ends the script: status 1, the failed steps named on stderr, when any
#                           step failed, else 0.
STEP_FAILURES=()

record() {
  local name=$1 rc=$2
  echo "$name exit $rc"
  ((rc == 0)) || STEP_FAILURES+=("$name (exit $rc)")
  return 0
}

run() {
  local limit=$1 log=$2
  shift 2
  local shown="${*//$PWD\//}"
  echo "===== $shown (limit ${limit}s) =====" >>"$log"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "===== exit $rc after $((SECONDS - t0))s =====" >>"$log"
  ((rc == 0)) || STEP_FAILURES+=("${shown:0:80} (exit $rc, $(basename "$log"))")
  return 0
}

finish() {
  if ((${#STEP_FAILURES[@]})); then
    echo "$(basename "$0"): ${#STEP_FAILURES[@]} step(s) failed:" >&2
    printf '  %s\n' "${STEP_FAILURES[@]}" >&2
    exit 1
  fi
  exit 0
}
