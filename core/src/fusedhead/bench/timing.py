"""Medians of wall time, and the GEMM unit every time is divided by.

The unit is one ``hidden @ weight.T`` of the case's shape and dtype timed in the same process (fp32
with TF32 off), so ratios hold across machines: forward's floor is 1 unit, forward + backward about 4.
On a GPU times are ``triton.testing.do_bench`` medians; on the CPU ``time.perf_counter`` medians.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: GPU timing: warm-up and timed window (ms) at least; do_bench fits its run count in them.
#: Windows of 1 s read 2-8 % above longer interleaved ones on an H200 (a 265 ms step is four runs
#: there); 2 s windows after a 0.5 s warm-up, interleaved with the GEMM unit, agree within 2 %.
CUDA_WARMUP_MS = 500.0
CUDA_WINDOW_MS = 2000.0
#: Runs per window at least, whatever its length: a median of fewer is one slow run away.
CUDA_MIN_RUNS = 8
#: GPU: rounds of (GEMM window, function window); the unit is the median of per-round ratios.
CUDA_ROUNDS = 2


def disable_tf32() -> None:
    """fp32 matmuls in full precision on CUDA (the GEMM unit of fp32 cases is defined so)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "ieee"
    else:  # older torch
        matmul.allow_tf32 = False


def median_ms(fn: Callable[[], object], device: torch.device, *, reps: int = 3) -> float:
    """Median milliseconds of ``fn()``, which must have run once already (compiled, warmed up)."""
    if device.type == "cuda":
        return _cuda_median_ms(fn, device, reps=reps)
    times = []
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(times))


def _cuda_median_ms(fn: Callable[[], object], device: torch.device, *, reps: int) -> float:
    """``do_bench`` median over a window of at least ``CUDA_WINDOW_MS`` and ``reps`` runs.

    The warm-up is as long as a few runs (clocks settle, the allocator reaches its steady
    state); a window of a few runs of a long step measured 5-8% slow on an H200, against the
    same step timed over a longer window.
    """
    from triton.testing import do_bench

    with torch.cuda.device(device):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate = start.elapsed_time(end)
        warmup = max(CUDA_WARMUP_MS, 3 * estimate)
        rep = max(CUDA_WINDOW_MS, (max(reps, CUDA_MIN_RUNS) + 0.5) * estimate)
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def gemm_fn(hidden: torch.Tensor, weight: torch.Tensor) -> Callable[[], object]:
    """The GEMM of the unit: ``hidden @ weight.T`` in the inputs' dtype and shape, no autograd."""
    h, w = hidden.detach(), weight.detach()

    def gemm() -> object:
        with torch.no_grad():
            return torch.mm(h, w.T)

    return gemm


def gemm_ms(hidden: torch.Tensor, weight: torch.Tensor, *, reps: int = 3) -> float:
    """One GEMM unit: median ms of ``hidden @ weight.T`` in the inputs' dtype and shape."""
    gemm = gemm_fn(hidden, weight)
    gemm()  # warm up (cuBLAS handles, heuristics, CPU thread pool)
    if hidden.device.type == "cuda":
        torch.cuda.synchronize(hidden.device)
    return median_ms(gemm, hidden.device, reps=reps)


def timed_units(
    fn: Callable[[], object],
    device: torch.device,
    *,
    reps: int,
    unit_ms: float,
    gemm: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Median ms of ``fn`` and the same in GEMM units.

    With ``gemm``: each repetition of ``fn`` is paired with one of the GEMM and the units are the
    median of the per-pair ratios (CPU: ``reps`` single runs each, where other processes make
    the speed drift; GPU: ``CUDA_ROUNDS`` windows each). Without it, the case's ``unit_ms``.
    """
    if gemm is None:
        ms = median_ms(fn, device, reps=reps)
        return {"ms": ms, "unit_ms": unit_ms, "units": ms / unit_ms}
    pairs = []
    if device.type == "cuda":  # interleaved windows: clock drift hits the unit and fn alike
        for _ in range(CUDA_ROUNDS):
            g = median_ms(gemm, device, reps=reps)
            pairs.append((median_ms(fn, device, reps=reps), g))
    else:
        for _ in range(max(1, reps)):
            g = median_ms(gemm, device, reps=1)
            f = median_ms(fn, device, reps=1)
            pairs.append((f, g))
    gemms = [g for _, g in pairs]
    return {
        "ms": float(statistics.median(f for f, _ in pairs)),
        "unit_ms": float(statistics.median(gemms)),
        "units": float(statistics.median(f / g for f, g in pairs)),
        # slowest over fastest paired GEMM: far from 1, the unit itself was unsteady (other load,
        # a GEMM too small to time) and the ms compare better than the units
        "unit_spread": max(gemms) / min(gemms) if min(gemms) > 0 else math.inf,
        "unit_samples": gemms,  # the paired GEMMs' ms, so a caller can pool several calls'
    }


def unit_steadiness(samples: list[float]) -> dict[str, Any]:
    """How far the GEMM unit can be trusted, from every paired GEMM of one implementation's
    measurement: ``unit_runs`` and ``unit_spread``, the slowest over the fastest (None with one
    run: its steadiness is unknown, and one run can be far off)."""
    steady = len(samples) > 1 and min(samples) > 0
    spread = max(samples) / min(samples) if steady else (math.inf if len(samples) > 1 else None)
    return {"unit_runs": len(samples), "unit_spread": spread}


def units(ms: float | None, unit_ms: float) -> float | None:
    """Milliseconds in GEMM units."""
    if ms is None or unit_ms <= 0:
        return None
    return ms / unit_ms
