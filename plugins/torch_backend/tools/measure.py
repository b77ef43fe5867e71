"""Measure the torch backend against full logits and verl's chunked algorithm, as docs/design.md does.

Times are medians (``time.perf_counter`` on the CPU, ``triton.testing.do_bench`` style CUDA events
on a GPU), in GEMM units (one ``hidden @ weight.T`` of the case's shape and dtype). Peak extra
memory: on the CPU the process's ``VmHWM`` growth, one subprocess per case; on CUDA
``max_memory_allocated`` minus what was allocated before the call. Errors are relative to an fp32
(GPU) or float64 (CPU) reference on the same input values. Not a test; a tuning aid.

    python plugins/torch_backend/tools/measure.py --device cpu --n 2048 --h 1024 --v 32000
    python plugins/torch_backend/tools/measure.py --device cuda --dtype bf16 --n 8192 --h 4096 --v 151936
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from fusedhead.protocol import call_backend

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str, peak: float = 1.0):
    """docs/design.md's inputs: h ~ N(0,1), W ~ N(0, (s/sqrt(H))^2), a tenth of labels ignored."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * (peak / math.sqrt(h))).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: n // 10]] = -100
    return hidden, weight, labels.to(device)


def run_torch_backend(hidden, weight, labels, temperature, options=None):
    from fusedhead_torch import TorchBackend, TorchOptions

    backend = TorchBackend(TorchOptions(**(options or {})))
    return call_backend(
        backend,
        hidden,
        weight,
        labels,
        temperature=temperature,
        ignore_index=-100,
        return_entropy=True,
        process_group=None,
        vocab_start=0,
        vocab_size=weight.shape[0],
        reduce_hidden_grad=True,
    )


def run_reference(hidden, weight, labels, temperature):
    from fusedhead.reference import reference_fused_head

    return reference_fused_head(hidden, weight, labels, temperature=temperature, ignore_index=-100)


def run_verl(hidden, weight, labels, temperature):
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
        _FusedLinearPPOFallbackFunction,
    )

    nll, ent = _FusedLinearPPOFallbackFunction.apply(
        hidden, weight, labels, temperature, -100, True
    )
    return -nll, ent


IMPLS: dict[str, Callable] = {
    "torch": run_torch_backend,
    "reference": run_reference,
    "verl": run_verl,
}


def fwd_bwd(fn, hidden, weight, labels, temperature, backward=True):
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    lp, ent = fn(h, w, labels, temperature)
    if backward:
        (lp.sum() + ent.float().sum()).backward()
    return lp, ent, h.grad, w.grad


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_time(f, device, reps):
    f()
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        f()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def vmhwm_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def vmrss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_peak_child(args) -> None:
    """In a subprocess: peak RSS growth of one forward+backward of ``args.impl``."""
    hidden, weight, labels = make_inputs(args.n, args.h, args.v, DTYPES[args.dtype], "cpu")
    fn = IMPLS[args.impl]
    opts = json.loads(args.options)
    if args.impl == "torch":
        fn = lambda *a: run_torch_backend(*a, options=opts)  # noqa: E731
    # Warm up on a small case so that allocator and library initialisation are not counted.
    fwd_bwd(fn, hidden[:8], weight[:64], labels[:8].clamp(max=63), args.temperature)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = vmrss_kib()
    out = fwd_bwd(fn, hidden, weight, labels, args.temperature)
    peak = vmhwm_kib()
    del out
    print(json.dumps({"peak_extra_mib": (peak - before) / 1024}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impls", default="torch,reference,verl")
    p.add_argument("--options", default="{}", help="TorchOptions as JSON")
    p.add_argument("--peaked", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "cpu-peak":
        cpu_peak_child(args)
        return
    dev, dtype = args.device, DTYPES[args.dtype]
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, labels = make_inputs(
        args.n, args.h, args.v, dtype, dev, 4.0 if args.peaked else 1.0
    )
    gemm = median_time(lambda: torch.mm(hidden, weight.T), dev, args.reps)
    ref_dtype = torch.float64 if dev == "cpu" else torch.float32
    ref = None
    results = {"case": vars(args), "gemm_ms": gemm * 1e3}
    opts = json.loads(args.options)
    for name in args.impls.split(","):
        fn = IMPLS[name]
        if name == "torch":
            fn = lambda *a: run_torch_backend(*a, options=opts)  # noqa: E731
        row = {}
        row["fwd_units"] = (
            median_time(
                lambda fn=fn: fwd_bwd(fn, hidden, weight, labels, args.temperature, backward=False),
                dev,
                args.reps,
            )
            / gemm
        )
        row["fwd_bwd_units"] = (
            median_time(
                lambda fn=fn: fwd_bwd(fn, hidden, weight, labels, args.temperature), dev, args.reps
            )
            / gemm
        )
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fwd_bwd(fn, hidden, weight, labels, args.temperature)
            torch.cuda.synchronize()
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        else:
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    "cpu-peak",
                    "--impl",
                    name,
                    "--n",
                    str(args.n),
                    "--h",
                    str(args.h),
                    "--v",
                    str(args.v),
                    "--dtype",
                    args.dtype,
                    "--temperature",
                    str(args.temperature),
                    "--options",
                    args.options,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            row["peak_extra_mib"] = json.loads(child.stdout.strip().splitlines()[-1])[
                "peak_extra_mib"
            ]
            out = fwd_bwd(fn, hidden, weight, labels, args.temperature)
        if ref is None:
            ref = fwd_bwd(
                lambda h, w, y, t: run_reference(h.to(ref_dtype), w.to(ref_dtype), y, t),
                hidden,
                weight,
                labels,
                args.temperature,
            )
        for key, a, b in zip(("log_prob", "entropy", "dh", "dw"), out, ref):
            a, b = a.double(), b.double()
            row[f"{key}_rel_err"] = ((a - b).norm() / b.norm()).item()
            row[f"{key}_max_abs"] = (a - b).abs().max().item()
        del out
        results[name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
