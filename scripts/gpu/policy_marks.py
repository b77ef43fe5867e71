"""Where the host's time goes in a policy-loss step, phase by phase, as the bench runs steps.

``python scripts/gpu/policy_marks.py [IMPL] [N]`` (default ``fused:triton`` 8192) on any CUDA
machine. Steps run back to back as ``triton.testing.do_bench`` runs them (no synchronize between
them). At each phase boundary of the core's call (the value checks' send and settle, the
backend's entry and return, the forward's return, the backward's read of its scale, its end) the
host's clock is read and a CUDA event recorded: per phase, the host's milliseconds and the GPU's
between the same two points of the stream (a phase of little GPU work whose GPU time is its host
time: the GPU waited for the host there). Then the
same with Python's garbage collector off, and the caching allocator's device mallocs per step.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import itertools

from policy_loss_bench import warm_step

import fusedhead.policy_output as policy_output
import fusedhead.value_checks as value_checks

MARKS: list[tuple[str, float, Any]] = []


def mark(name: str) -> None:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    MARKS.append((name, time.perf_counter(), ev))


def wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    fn = getattr(owner, attr)

    def wrapped(*a: Any, **k: Any) -> Any:
        if before:
            mark(before)
        out = fn(*a, **k)
        if after:
            mark(after)
        return out

    setattr(owner, attr, wrapped)


def instrument(backend_cls: type | None) -> None:
    wrap(value_checks.Pending, "send", "send", None)
    wrap(value_checks.Pending, "settle", None, "settled")
    if backend_cls is not None:
        wrap(backend_cls, "policy_loss", "backend in", "backend out")
    wrap(policy_output, "_scale_", None, "bwd scale read")


def run(step: Callable[[], None], steps: int) -> dict[str, list[tuple[float, float]]]:
    """Per phase: (host ms, GPU ms between the same two points of the stream) of each step,
    the steps back to back (one synchronize after the last)."""
    runs = []
    for _ in range(steps):
        MARKS.clear()
        step()
        runs.append(list(MARKS))
    torch.cuda.synchronize()
    phases: dict[str, list[tuple[float, float]]] = {}
    for marks in runs:
        for (_, t_a, e_a), (name, t_b, e_b) in itertools.pairwise(marks):
            phases.setdefault(name, []).append(((t_b - t_a) * 1e3, e_a.elapsed_time(e_b)))
    return phases


def report(title: str, phases: dict[str, list[tuple[float, float]]]) -> None:
    print(f"## {title}")
    for name, vals in phases.items():
        host = statistics.median(v[0] for v in vals)
        gpu = statistics.median(v[1] for v in vals)
        print(f"  to {name:16s} host {host:7.3f} ms   GPU {gpu:7.3f} ms")


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "fused:triton"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    fn, h, w = warm_step(spec, n)
    cls = None
    if spec.startswith("fused:triton"):
        from fusedhead_triton.backend import TritonBackend

        cls = TritonBackend
    instrument(cls)

    def step() -> None:
        mark("start")
        loss = fn(h, w)
        mark("forward out")
        loss.backward()
        mark("backward out")

    # back to back, as do_bench: the previous step's last kernels still queued at the next start
    for label, collect in (("gc on", True), ("gc off", False)):
        if not collect:
            gc.disable()
        stats0 = torch.cuda.memory_stats()
        phases = run(step, 12)
        stats1 = torch.cuda.memory_stats()
        gc.enable()
        mallocs = stats1.get("segment.all.allocated", 0) - stats0.get("segment.all.allocated", 0)
        retries = stats1.get("num_alloc_retries", 0) - stats0.get("num_alloc_retries", 0)
        report(f"{spec} N={n}, {label}: device mallocs {mallocs}, alloc retries {retries}", phases)
    # whole steps back to back, events around each, no synchronize between
    evs = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(h, w).backward()
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in evs)
    print(f"{spec} N={n}: back-to-back step {ms[len(ms) // 2]:.2f} ms (median of 12)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
