"""Where a triton forward + backward's wall time goes between kernels: the GPU's idle gaps.

    python plugins/triton_backend/tools/timeline.py OUT_DIR [--n 8192] [--memory low]

One CUDA device, bf16, H = 4096, V = 151936, T = 0.7. Times one step with CUDA events (median of
several), then profiles one step (CPU and CUDA activity) and lists every kernel with the idle
gap before it, and the CPU ops that ran during the largest gaps. Writes OUT_DIR/timeline.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--memory", default="low")
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, h, v = args.n, args.hidden, args.vocab
    hid = torch.randn(n, h, generator=g, device=dev).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g, device=dev) / h**0.5).bfloat16().requires_grad_()
    lab = torch.randint(0, v, (n,), generator=g, device=dev)
    g1, g2 = torch.randn(n, device=dev), torch.randn(n, device=dev)
    be = TritonBackend(TritonOptions(memory=args.memory))

    def step() -> None:
        hid.grad = w.grad = None
        lp, ent = call_backend(be, hid, w, lab, temperature=0.7)
        torch.autograd.backward([lp, ent], [g1, g2])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = list(prof.events())
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    rows: list[dict[str, Any]] = []
    prev_end = kernels[0].time_range.start if kernels else 0
    for k in kernels:
        gap = (k.time_range.start - prev_end) / 1e3
        rows.append(
            {
                "name": k.name[:80],
                "start_ms": (k.time_range.start - kernels[0].time_range.start) / 1e3,
                "ms": (k.time_range.end - k.time_range.start) / 1e3,
                "gap_before_ms": gap,
                "_s": prev_end,
                "_e": k.time_range.start,
            }
        )
        prev_end = max(prev_end, k.time_range.end)
    busy = sum(r["ms"] for r in rows)
    span = (prev_end - kernels[0].time_range.start) / 1e3 if kernels else 0.0
    worst = sorted(rows, key=lambda r: -r["gap_before_ms"])[:8]
    for r in worst:  # the CPU ops that overlap the gap, longest first
        s, e = r["_s"], r["_e"]
        during = [
            (c.name, (min(c.time_range.end, e) - max(c.time_range.start, s)) / 1e3)
            for c in cpu
            if c.time_range.end > s and c.time_range.start < e
        ]
        r["cpu_during_gap"] = sorted(during, key=lambda x: -x[1])[:6]
    for r in rows:
        r.pop("_s")
        r.pop("_e")
    result = {
        "shape": [n, h, v],
        "memory": args.memory,
        "event_ms_median": statistics.median(times),
        "event_ms_all": times,
        "kernel_busy_ms": busy,
        "kernel_span_ms": span,
        "idle_in_span_ms": span - busy,
        "kernels": len(rows),
        "largest_gaps": worst,
        "timeline": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "timeline.json").write_text(json.dumps(result, indent=1))
    print(
        f"N={n} memory={args.memory}: step {result['event_ms_median']:.2f} ms (events), kernels busy "
        f"{busy:.2f} ms over a span of {span:.2f} ms, {len(rows)} kernels"
    )
    for r in worst:
        print(f"  gap {r['gap_before_ms']:.3f} ms before {r['name']} at {r['start_ms']:.2f} ms")
        for name, ms in r["cpu_during_gap"]:
            print(f"      cpu {ms:.3f} ms {name[:70]}")


if __name__ == "__main__":
    main()
