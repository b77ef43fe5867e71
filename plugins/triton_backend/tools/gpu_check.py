"""Where the triton backend's forward + backward spends its time on a GPU, kernel by kernel.

Usage on a CUDA machine (writes gpu_check.json to --out):
    python plugins/triton_backend/tools/gpu_check.py [--n 8192,32768] [--memory low,fast] [--out DIR]
    ncu --kernel-name regex:dh_ --launch-skip 4 --launch-count 2 --section LaunchStats \\
        --section SpeedOfLight python plugins/triton_backend/tools/gpu_check.py --once --n 8192

For each N and memory setting: fwd and fwd+bwd medians (``triton.testing.do_bench``) in GEMM units
(one cuBLAS ``hidden @ weight.T`` of the shape, timed beside them), the peak memory beyond the
inputs, and a ``torch.profiler`` breakdown of one fwd+bwd by kernel family (forward stats,
combine, dz, dh, cuBLAS's dW GEMMs, other) with launch counts. ``--once`` runs one warmed-up
fwd+bwd and exits (for ncu). ``--dry`` runs tiny shapes on the CPU interpreter.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--n", default="8192,32768", help="token counts")
ARGS.add_argument("--hidden", type=int, default=4096)
ARGS.add_argument("--vocab", type=int, default=151936)
ARGS.add_argument("--memory", default="low,fast", help="memory settings to measure")
ARGS.add_argument("--once", action="store_true", help="one warmed-up fwd+bwd, then exit (ncu)")
ARGS.add_argument("--dry", action="store_true", help="CPU interpreter, tiny shapes")
ARGS.add_argument("--quick", action="store_true", help="N = 8192 only (run_all.sh's default)")
ARGS.add_argument("--budget-s", type=float, default=240.0, help="stop after this many seconds")
ARGS.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
OPTS = ARGS.parse_args()
if OPTS.dry:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from fusedhead.protocol import call_backend  # noqa: E402
from fusedhead_triton import TritonBackend, TritonOptions  # noqa: E402

DEV = torch.device("cpu" if OPTS.dry else "cuda")
DTYPE = torch.float16 if OPTS.dry else torch.bfloat16
FAMILIES = (("fwd_stats", "fwd_stats"), ("combine", "combine"), ("dz", "dz_"), ("dh", "dh_"))


def inputs(n: int, h: int, v: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(0)
    hid = torch.randn(n, h, generator=g, device=DEV).to(DTYPE)
    w = (torch.randn(v, h, generator=g, device=DEV) / h**0.5).to(DTYPE).requires_grad_()
    lab = torch.randint(0, v, (n,), generator=g, device=DEV)
    return hid.requires_grad_(), w, lab, torch.randn(n, device=DEV), torch.randn(n, device=DEV)


def step_fn(be: TritonBackend, hid: Any, w: Any, lab: Any, g1: Any, g2: Any, train: bool) -> Any:
    def step() -> None:
        hid.grad = w.grad = None
        with torch.set_grad_enabled(train):
            lp, ent = call_backend(be, hid, w, lab, temperature=0.7)
            if train:
                torch.autograd.backward([lp, ent], [g1, g2])

    return step


def median_ms(fn: Any) -> float:
    if OPTS.dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=500, rep=2000, return_mode="median"))


def breakdown(fn: Any) -> dict[str, Any]:
    """Kernel time (ms) and launches of one call of ``fn``, by family."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ms: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        fam = next((f for f, key in FAMILIES if key in ev.name), None)
        if fam is None:
            fam = "dw_gemm" if ("gemm" in ev.name.lower() or "sm90" in ev.name) else "other"
        ms[fam] += ev.device_time / 1e3
        count[fam] += 1
    return {"ms": dict(ms), "launches": dict(count), "total_ms": sum(ms.values())}


def measure(n: int, memory: str) -> dict[str, Any]:
    h, v = (64, 333) if OPTS.dry else (OPTS.hidden, OPTS.vocab)
    be = TritonBackend(TritonOptions(memory=memory))
    hid, w, lab, g1, g2 = inputs(n, h, v)
    train = step_fn(be, hid, w, lab, g1, g2, True)
    infer = step_fn(be, hid, w, lab, g1, g2, False)
    train()
    if OPTS.once:
        train()
        return {}
    hd, wd = hid.detach(), w.detach()
    gemm = lambda: torch.mm(hd, wd.T)  # noqa: E731
    row: dict[str, Any] = {"n": n, "h": h, "v": v, "memory": memory}
    unit = median_ms(gemm)
    row.update(unit_ms=unit, fwd_ms=median_ms(infer), fwd_bwd_ms=median_ms(train))
    row.update(fwd_units=row["fwd_ms"] / unit, fwd_bwd_units=row["fwd_bwd_ms"] / unit)
    if DEV.type == "cuda":
        hid.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train()
        torch.cuda.synchronize()
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        row["kernels"] = breakdown(train)
        row["kernels"]["units"] = {k: x / unit for k, x in row["kernels"]["ms"].items()}
    print(json.dumps({k: x for k, x in row.items() if k != "kernels"}), flush=True)
    print("   ", {k: round(x, 3) for k, x in row.get("kernels", {}).get("units", {}).items()})
    return row


def main() -> None:
    t0 = time.time()
    counts = [8192] if OPTS.quick else [int(x) for x in OPTS.n.split(",") if x]
    if OPTS.dry:
        counts = [40]
    rows = []
    for n in counts:
        for memory in [m for m in OPTS.memory.split(",") if m]:
            if time.time() - t0 > OPTS.budget_s:
                print(f"budget of {OPTS.budget_s:g} s spent: N = {n} {memory} not run")
                continue
            rows.append(measure(n, memory))
            torch.cuda.empty_cache() if DEV.type == "cuda" else None
    if OPTS.once:
        return
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "commit": os.environ.get("FUSEDHEAD_GIT_COMMIT", ""),
    }  # fmt: skip
    os.makedirs(OPTS.out, exist_ok=True)
    with open(os.path.join(OPTS.out, "gpu_check.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
