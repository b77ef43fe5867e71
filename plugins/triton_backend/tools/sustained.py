"""Kernel time under sustained load against after idle, with the SM clock and power beside it.

    python plugins/triton_backend/tools/sustained.py OUT_DIR [--n 8192] [--memory low]

One CUDA device, bf16, H = 4096, V = 151936, T = 0.7. For the GEMM unit, the triton forward and
the triton forward + backward: a 2 s back-to-back window timed with CUDA events per run, then three
runs profiled at once (still under load), then three runs profiled each after 1 s idle. nvidia-smi
(where present) samples the SM clock and the board power every 50 ms throughout. Whether the
profiled kernel time of one step differs from its event time because of the clocks (idle against
sustained) or because of time between kernels is read off ``OUT_DIR/sustained.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu"


def kernel_ms(fn: Callable[[], object], runs: int, idle_s: float) -> list[float]:
    """Sum of the CUDA kernels' durations of each of ``runs`` runs, profiled one by one."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for _ in range(runs):
        if idle_s:
            torch.cuda.synchronize()
            time.sleep(idle_s)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out.append(sum(e.time_range.end - e.time_range.start for e in cuda) / 1e3)
    return out


def window(fn: Callable[[], object], seconds: float) -> tuple[list[float], float, float]:
    """Event times of back-to-back runs over ``seconds``, and the window's wall start/end."""
    times: list[float] = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times, t0, time.time()


def smi_between(samples: list[list[str]], t0: float, t1: float) -> dict[str, float]:
    """Mean SM clock (MHz) and power (W) of the nvidia-smi samples taken in [t0, t1]."""
    rows = []
    for s in samples:
        try:
            stamp = time.mktime(time.strptime(s[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            rows.append((stamp, float(s[1]), float(s[2]), float(s[3])))
        except (ValueError, IndexError):
            continue
    inside = [r for r in rows if t0 - 0.5 <= r[0] <= t1 + 0.5]
    if not inside:
        return {}
    return {
        "sm_mhz": statistics.mean(r[1] for r in inside),
        "sm_mhz_min": min(r[1] for r in inside),
        "power_w": statistics.mean(r[2] for r in inside),
        "temp_c": max(r[3] for r in inside),
        "samples": len(inside),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--memory", default="low")
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, h, v = args.n, 4096, 151936
    hid = torch.randn(n, h, generator=g, device=dev).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g, device=dev) / h**0.5).bfloat16().requires_grad_()
    lab = torch.randint(0, v, (n,), generator=g, device=dev)
    g1, g2 = torch.randn(n, device=dev), torch.randn(n, device=dev)
    be = TritonBackend(TritonOptions(memory=args.memory))

    def gemm() -> object:
        with torch.no_grad():
            return torch.mm(hid, w.T)

    def forward() -> object:
        with torch.no_grad():
            return call_backend(be, hid.detach(), w.detach(), lab, temperature=0.7)

    def step() -> None:
        hid.grad = w.grad = None
        lp, ent = call_backend(be, hid, w, lab, temperature=0.7)
        torch.autograd.backward([lp, ent], [g1, g2])

    smi = None
    smi_log = args.out_dir / "smi.csv"
    if shutil.which("nvidia-smi"):
        with smi_log.open("w") as f:
            smi = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                 "-lms", "50"],
                stdout=f, stderr=subprocess.DEVNULL,
            )  # fmt: skip
    result: dict[str, Any] = {"shape": [n, h, v], "memory": args.memory, "phases": {}}
    spans = {}
    for name, fn in (("gemm", gemm), ("forward", forward), ("step", step)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times, t0, t1 = window(fn, args.seconds)
        loaded = kernel_ms(fn, 3, 0.0)
        idle = kernel_ms(fn, 3, 1.0)
        spans[name] = (t0, t1)
        result["phases"][name] = {
            "event_ms_median": statistics.median(times),
            "event_runs": len(times),
            "kernel_ms_loaded": loaded,
            "kernel_ms_after_idle": idle,
        }
        print(
            f"{name}: events {statistics.median(times):.2f} ms ({len(times)} runs); kernels "
            f"loaded {statistics.median(loaded):.2f}, after 1 s idle {statistics.median(idle):.2f}"
        )
    if smi is not None:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
        samples = [line.split(", ") for line in smi_log.read_text().splitlines()]
        for name, (t0, t1) in spans.items():
            result["phases"][name]["smi"] = smi_between(samples, t0, t1)
            print(f"  {name} window: {result['phases'][name]['smi']}")
    (args.out_dir / "sustained.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
