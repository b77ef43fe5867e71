#!/usr/bin/env bash
# policy_one_call.sh OUT: the policy loss's GPU checks and times in one call of a 10-minute limit,
# from the repository root on any CUDA machine with torch and triton, with .gpu-tmp carried
# (ab.sh pack REV... made here first, e.g. `bash scripts/gpu/ab.sh pack 6af4745 main`: the bf16
# weight-gradient sum beside the fp32 one); installs by scripts/gpu/setup_tree.sh (from pip's
# index, or from a carried .gpu-wheels/{small,install-wheels} on a machine without one, such as
# the one lent here):
#   1. sanity.log: aten::addmm.dtype_out adds into fp32 in place; beta 0 ignores a NaN-filled input;
#   2. ab/ab.jsonl: ab.sh's policy case for each packed tree, N = AB_N (default 8192 and 32768),
#      AB_ROUNDS rounds (default 2)
#      (time, GEMM units, peak, the weight gradient's error against fp32 at N = 8192);
#   3. this tree installed again (reinstall.log; the script stops with status 1 when that fails),
#      then checks.log: fusedhead check {triton,torch} --device cuda --dtype bf16 -k policy;
#   4. policy.json / policy.md: fusedhead bench --case policy (triton, unfused:triton), as time allows.
# DEADLINE (s, default 570) bounds the whole; each step gets what is left (steps 3-4 only if
# more than 100 s are; left out for time, they are only noted). The exit status is 1 when any step
# failed ("NAME exit N").
set -uo pipefail
OUT=${1:?usage: policy_one_call.sh OUT}; mkdir -p "$OUT"; T0=$SECONDS
left() { echo $(( ${DEADLINE:-570} - (SECONDS - T0) )); }
[[ -f .gpu-stamp ]] && export FUSEDHEAD_GIT_COMMIT=$(<.gpu-stamp)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
python3 - > "$OUT/sanity.log" 2>&1 <<'PY'
import torch
a=torch.randn(4096,3000,device="cuda",dtype=torch.bfloat16); b=torch.randn(3000,4096,device="cuda",dtype=torch.bfloat16)
ref=a.double()@b.double()
p=torch.full((4096,4096),float("nan"),device="cuda"); torch.addmm(p,a,b,beta=0,out_dtype=torch.float32,out=p)
print("beta0 finite", bool(p.isfinite().all()), float((p.double()-ref).norm()/ref.norm()))
c=p.clone(); torch.addmm(c,a,b,out_dtype=torch.float32,out=c)
print("add err", float((c.double()-2*ref).norm()/(2*ref).norm()), torch.__version__)
PY
record sanity $? >> "$OUT/sanity.log"
cat "$OUT/sanity.log"
AB_N=${AB_N:-8192 32768} AB_LIMIT=150 bash "$HERE/ab.sh" run "$OUT/ab" "${AB_ROUNDS:-2}" policy > "$OUT/ab.log" 2>&1
record ab $? >> "$OUT/ab.log"
echo "ab done at $((SECONDS-T0)) s"; tail -1 "$OUT/ab.log"; cut -c1-600 "$OUT/ab/ab.jsonl"; tail -3 "$OUT/ab/ab.err"
: > "$OUT/reinstall.log"
source "$HERE/setup_tree.sh" "$OUT/reinstall.log" || exit 1
(( $(left) > 100 )) && for b in triton torch; do
  timeout -k 5 $(( $(left) < 100 ? $(left) : 100 )) python3 -m fusedhead.cli check "$b" --device cuda --dtype bf16 -k policy
  record "check $b" $?
done > "$OUT/checks.log" 2>&1
tail -n 16 "$OUT/checks.log"; echo "checks done at $((SECONDS-T0)) s"
L=$(left); (( L > 60 )) && { timeout -k 5 $((L-10)) python3 -m fusedhead.cli bench --device cuda --dtype bf16 \
  --n 8192 32768 --hidden 4096 --vocab 151936 --temperature 0.7 --case policy --max-minutes $(( (L-40)/60 > 0 ? (L-40)/60 : 1 )) \
  --impl triton unfused:triton --json "$OUT/policy.json" --markdown "$OUT/policy.md" > "$OUT/bench.log" 2>&1; record bench $?; tail -n 12 "$OUT/bench.log"; }
echo "all done at $((SECONDS-T0)) s"
finish
