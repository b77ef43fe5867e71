"""The torch backend's two logits paths in bf16: logits rounded to bf16, or accumulated in fp32.

    python plugins/torch_backend/tools/logits_precision.py OUT_DIR            # a CUDA GPU, full size
    python plugins/torch_backend/tools/logits_precision.py OUT_DIR --device cpu --n 2048 --h 1024 \\
        --v 32000
    python plugins/torch_backend/tools/logits_precision.py OUT_DIR --small    # smoke test, CPU

For each path (``fp32_logits`` false / true): milliseconds of a forward and of a forward+backward
(median of ``--reps``, after a warm-up; CUDA events on a GPU), the peak memory beyond the inputs
(CUDA: ``max_memory_allocated`` minus what was allocated before; CPU: the growth of the peak RSS
of a fresh subprocess), and the errors against an fp32 reference computed from the same bf16 values
(full logits row block by row block, TF32 off; float64 on the CPU): max absolute and relative-norm
errors of log-probs and entropy, relative-norm errors of both gradients. Writes
``OUT_DIR/logits_precision.json`` and prints one line per path.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fusedhead.protocol import call_backend
from fusedhead_torch import TorchBackend, TorchOptions

TEMPERATURE = 0.7
IGNORE = -100
SMALL = {"n": 256, "h": 64, "v": 3000}


def make_inputs(
    n: int, h: int, v: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h ~ N(0, 1), W ~ N(0, 1/H) in bf16, a tenth of the labels ignored (seeded)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: n // 10]] = IGNORE
    return hidden, weight, labels.to(device)


def run_path(
    fp32_logits: bool,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One call of the torch backend (default options but the path), with the loss sum(lp + H)."""
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    backend = TorchBackend(TorchOptions(fp32_logits=fp32_logits))
    lp, ent = call_backend(backend, h, w, labels, temperature=TEMPERATURE, ignore_index=IGNORE)
    assert ent is not None
    if backward:
        (lp.sum() + ent.sum()).backward()  # type: ignore[no-untyped-call]
    return lp.detach(), ent.detach(), h.grad, w.grad


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs, entropy and the gradients of sum(lp + H) from full ``dtype`` logits, by rows."""
    w = weight.to(dtype).requires_grad_()
    n = hidden.shape[0]
    rows = max(1, (1 << 28) // (weight.shape[0] * torch.finfo(dtype).bits // 8))  # ~256 MiB
    lps, ents, dhs = [], [], []
    for r0 in range(0, n, rows):
        h = hidden[r0 : r0 + rows].to(dtype).requires_grad_()
        y = labels[r0 : r0 + rows]
        logp = torch.log_softmax((h @ w.T) / TEMPERATURE, dim=-1)
        valid = y != IGNORE
        lp = logp.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
        lp = torch.where(valid, lp, torch.zeros_like(lp))
        ent = -(logp.exp() * logp).sum(dim=-1)
        ent = torch.where(valid, ent, torch.zeros_like(ent))
        (lp.sum() + ent.sum()).backward()  # type: ignore[no-untyped-call]
        lps.append(lp.detach())
        ents.append(ent.detach())
        assert h.grad is not None
        dhs.append(h.grad)
        del logp
    assert w.grad is not None
    return torch.cat(lps), torch.cat(ents), torch.cat(dhs), w.grad


def errors(got: tuple[Any, ...], want: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Max-abs and relative-norm errors of the outputs; relative-norm errors of the gradients."""
    out: dict[str, float] = {}
    for name, a, b in zip(("log_prob", "entropy", "dh", "dw"), got, want):
        a64, b64 = a.double(), b.double()
        if name in ("log_prob", "entropy"):
            out[f"{name}_max_abs"] = float((a64 - b64).abs().max())
        out[f"{name}_rel_err"] = float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))
    return out


def median_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall time of ``fn`` in ms (CUDA: events around each call), after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def cuda_peak_gib(fn: Callable[[], object]) -> float:
    """Peak allocated memory during ``fn`` beyond what was allocated before, in GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**30


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def cpu_peak_child(args: argparse.Namespace) -> None:
    """In a fresh process: peak RSS growth (GiB) of one forward+backward of one path."""
    hidden, weight, labels = make_inputs(args.n, args.h, args.v, "cpu")
    run_path(args.fp32_logits == "1", hidden[:8], weight[:64], labels[:8].clamp(max=63), True)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    out = run_path(args.fp32_logits == "1", hidden, weight, labels, True)
    peak = _status_kib("VmHWM")
    del out
    print(json.dumps({"peak_extra_gib": (peak - before) / 2**20}))


def cpu_peak_gib(args: argparse.Namespace, fp32_logits: bool) -> float | None:
    """``cpu_peak_child`` in a subprocess; None where /proc cannot reset the peak."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    cmd = [sys.executable, __file__, "unused", "--child", "--fp32-logits", str(int(fp32_logits))]
    cmd += ["--n", str(args.n), "--h", str(args.h), "--v", str(args.v)]
    child = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(json.loads(child.stdout.strip().splitlines()[-1])["peak_extra_gib"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="folder for logits_precision.json")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--small", action="store_true", help=f"a CPU smoke test: {SMALL}, 2 reps")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fp32-logits", default="0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.small:
        args.device, args.reps = "cpu", 2
        args.n, args.h, args.v = SMALL["n"], SMALL["h"], SMALL["v"]
    if args.child:
        cpu_peak_child(args)
        return {}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is fp32, not TF32
    hidden, weight, labels = make_inputs(args.n, args.h, args.v, device)
    want = reference(hidden, weight, labels, torch.float32 if device == "cuda" else torch.float64)
    gemm_ms = median_ms(lambda: torch.mm(hidden, weight.T), device, args.reps)
    result: dict[str, Any] = {
        "shape": {"n": args.n, "h": args.h, "v": args.v, "dtype": "bf16", "T": TEMPERATURE},
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "bf16_gemm_ms": gemm_ms,
        "paths": {},
    }
    for fp32_logits in (False, True):
        name = "fp32_logits" if fp32_logits else "bf16_logits"
        got = run_path(fp32_logits, hidden, weight, labels, True)
        row: dict[str, Any] = errors(got, want)
        del got
        fwd = partial(run_path, fp32_logits, hidden, weight, labels, False)
        fwd_bwd = partial(run_path, fp32_logits, hidden, weight, labels, True)
        row["fwd_ms"] = median_ms(fwd, device, args.reps)
        row["fwd_bwd_ms"] = median_ms(fwd_bwd, device, args.reps)
        if device == "cuda":
            row["peak_extra_gib"] = cuda_peak_gib(fwd_bwd)
        else:
            row["peak_extra_gib"] = cpu_peak_gib(args, fp32_logits)
        result["paths"][name] = row
        print(name, json.dumps(row), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "logits_precision.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
