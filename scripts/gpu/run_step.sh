#!/usr/bin/env bash
# run_step.sh: sourced by the GPU scripts for `run LIMIT_S LOG CMD...`: one step, its command line
# (the repository's path left out) and its output appended to LOG, its exit status and seconds
# after; never failing the script, so that a step cut by its limit leaves the next ones to run.
run() {
  local limit=$1 log=$2
  shift 2
  echo "===== ${*//$PWD\//} (limit ${limit}s) =====" >>"$log"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  echo "===== exit $? after $((SECONDS - t0))s =====" >>"$log"
}
