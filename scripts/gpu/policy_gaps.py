"""Where a policy-loss step leaves the GPU idle: the gaps between its kernels on the stream.

One step of ``policy_loss_bench.py``'s IMPL (default ``fused:triton``) at N = 8192: its time
alone and with the GPU busy beforehand (the host's work before the step's one read then overlaps
it, as in a trainer), then under torch.profiler its span, its kernels' total, and every gap over
20 us with the kernels on either side and the CPU ops that overlap it.

    python scripts/gpu/policy_gaps.py OUT_DIR [IMPL] [--n N]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import itertools

from policy_loss_bench import warm_step


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    n = 8192
    if "--n" in args:
        i = args.index("--n")
        n = int(args[i + 1])
        del args[i : i + 2]
    spec = args[0] if args else "fused:triton"
    fn, h, w = warm_step(spec, n)
    for busy in (False, True):
        times = []
        for _ in range(5):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if busy:  # the GPU busy before the step, as after a model's forward in a trainer
                torch.cuda._sleep(50_000_000)
            start.record()
            fn(h, w).backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        what = "after 50M cycles of GPU sleep" if busy else "alone"
        print(f"{spec} N={n}: one step {sorted(times)[2]:.2f} ms, median of 5, {what} (events)")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn(h, w).backward()
        torch.cuda.synchronize()
    trace = out / f"trace-{spec.replace(':', '_').replace('=', '-')}-{n}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("dur", 0) > 0]
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    print(f"kernels {len(kernels)}, busy {busy / 1e3:.2f} ms, span {span / 1e3:.2f} ms")
    gaps = []
    for a, b in itertools.pairwise(kernels):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > 20:
            t0, t1 = a["ts"] + a["dur"], b["ts"]
            over = [c["name"] for c in cpu_ops if c["ts"] < t1 and c["ts"] + c["dur"] > t0]
            longest = sorted(
                (c for c in cpu_ops if c["ts"] < t1 and c["ts"] + c["dur"] > t0),
                key=lambda c: -c["dur"],
            )[:4]
            gaps.append(gap)
            print(
                f"gap {gap / 1e3:7.3f} ms after {a['name'][:50]!r} before {b['name'][:50]!r}; "
                f"cpu ops {len(over)}: "
                + ", ".join(f"{c['name'][:40]} {c['dur'] / 1e3:.2f}ms" for c in longest)
            )
    print(f"gaps over 20 us: {len(gaps)}, {sum(gaps) / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
