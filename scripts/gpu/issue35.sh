#!/usr/bin/env bash
# issue35.sh OUT: issue 35 in one call on a CUDA machine of 2 or 4 GPUs (e.g. nvidia-h200-x2 / -x4),
# from the repository root, with torch and triton (and .gpu-stamp where the machine's .git is not
# the tree's: scripts/gpu/stamp.sh):
#   1. this tree installed by scripts/gpu/setup_tree.sh --liger (from pip's index, or from a carried
#      .gpu-wheels/{small,install-wheels} on a machine without one, such as the one lent here);
#      when that fails the script stops with status 1;
#   2. scripts/gpu/degree_nccl.py under torchrun, NCCL with NVLS off, one process per GPU (4 when
#      4 are visible, else 2; NPROC to choose): torch and triton, bf16, N = 8192 and 32768,
#      H = 4096, V = 151936, grid shards; degree 2, and 4 when 4 GPUs run (degree 2 then as two
#      groups side by side): bits against each rank's one-GPU call, gradients, fwd+bwd time,
#      GEMM units and peak memory beside the one-GPU call and the previous combine
#      -> OUT/degree2.json, OUT/degree4.json (rewritten after every case), OUT/degree_nccl.log.
# About 5 minutes (setup 1-2, the run 3-4); DEADLINE_S (default 540) bounds the whole call: the
# script stops starting cases 100 s before it, torchrun is killed 15 s before it. The exit status
# is degree_nccl's ("degree_nccl exit N"): 1 when it failed or was killed.
set -uo pipefail
OUT=${1:?usage: issue35.sh OUT}
mkdir -p "$OUT"
START=$SECONDS
DEADLINE_S=${DEADLINE_S:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/run_step.sh" # record NAME RC; finish
{
  nvidia-smi -L
  nvidia-smi topo -m
} >"$OUT/setup.log" 2>&1
source "$HERE/setup_tree.sh" "$OUT/setup.log" --liger --env || exit 1
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NPROC=${NPROC:-$(((GPUS >= 4)) && echo 4 || echo 2)}
left=$((DEADLINE_S - (SECONDS - START)))
echo "setup done after $((SECONDS - START))s; $GPUS GPUs, $NPROC processes, ${left}s left"
VP_DEADLINE_S=$((left - 100)) timeout -k 10 $((left - 15)) \
  python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$HERE/degree_nccl.py" "$OUT" \
  >"$OUT/degree_nccl.log" 2>&1
rc=$?
record degree_nccl "$rc" >/dev/null
echo "degree_nccl exit $rc after $((SECONDS - START))s" | tee -a "$OUT/degree_nccl.log"
python3 - "$OUT" <<'PY' || true
import json, pathlib, sys
gib = lambda p: "-" if p is None else f"{p['total']:.2f}"
for path in sorted(pathlib.Path(sys.argv[1]).glob("degree[0-9]*.json")):
    d = json.loads(path.read_text())
    print(f"{path.name}: done={d['done']} skipped={len(d['skipped'])}")
    for r in d["checks"] + d["timings"]:
        if "error" in r:
            print(f"  rank {r['rank']} {r['backend']} N={r['N']} ERROR {r['error'][:300]}")
    cases = {(r["backend"], r["N"]) for r in d["checks"] if "error" not in r}
    for b, n in sorted(cases):
        rs = [r for r in d["checks"] if (r["backend"], r["N"]) == (b, n) and "error" not in r]
        bits = all(all(r["bitwise"].values()) for r in rs)
        diff = max(max(r["max_abs_diff"].values()) for r in rs)
        grad = max(max(r["grad_rel_l2"].values()) for r in rs)
        print(f"  {b} N={n} ranks {len(rs)}: bitwise {bits} (max abs diff {diff:.1e}), "
              f"grads <= {grad:.1e}: {'PASS' if all(r['pass'] for r in rs) else 'FAIL'}")
    for r in d["timings"]:
        if r["rank"] != 0 or "error" in r:
            continue
        s, c = r["single_gpu"], r["combine"]
        print(f"  {r['backend']} N={r['N']} rank 0: {r['fwd_bwd_ms']:.1f} ms "
              f"{r['fwd_bwd_units']:.2f} u peak {gib(r['peak_gib'])} GiB | one GPU "
              f"{s['fwd_bwd_ms']:.1f} ms {s['fwd_bwd_units']:.2f} u peak {gib(s['peak_gib'])} GiB"
              f" | combine {c['today']['ms']:.3f} ms ({100 * c['today_fraction_of_fwd_bwd']:.2f}"
              f" %), previous {c['previous']['ms']:.3f} ms")
PY
finish
