"""One implementation on one case: accuracy, peak extra memory, forward and forward+backward time.

The first forward + backward (which also compiles and warms up) gives the outputs and gradients
compared with the reference. Forward is timed as inference (``no_grad`` on inputs that need no
gradient); forward + backward as training, with gradients accumulated into allocated ``.grad``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fusedhead.bench import accuracy, memory, policy, timing
from fusedhead.bench.cases import Case, Inputs
from fusedhead.bench.peers import Fn, Impl


def backward(lp: torch.Tensor, ent: torch.Tensor | None, inputs: Inputs) -> None:
    """Backward of one call's outputs: a loss (0-d, the ``policy`` case) as it is, per-token
    outputs with the case's upstream gradients."""
    if lp.dim() == 0:
        torch.autograd.backward([lp])
    elif ent is None:
        torch.autograd.backward([lp], [inputs.grad_log_probs])
    else:
        torch.autograd.backward([lp, ent], [inputs.grad_log_probs, inputs.grad_entropy])


def make_step(fn: Fn, h: torch.Tensor, w: torch.Tensor, inputs: Inputs) -> Callable[[], None]:
    """Forward + backward of ``fn`` with the case's upstream gradients, accumulating into ``.grad``."""
    labels = inputs.labels

    def step() -> None:
        lp, ent = fn(h, w, labels)
        backward(lp, ent, inputs)

    return step


def nonfinite(tensors: dict[str, torch.Tensor | None]) -> list[str]:
    """The names of the floating tensors holding a NaN or an inf: checked on every case, with or
    without a reference (``--no-accuracy``, the cases that have none), so that such a result is an
    error, never a time."""
    return [
        name
        for name, t in tensors.items()
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    case: Case,
    impl: Impl,
    inputs: Inputs,
    ref: accuracy.Reference | policy.Reference | None,
    *,
    unit_ms: float,
    reps: int,
    measure_memory: bool = True,
    forward: bool = True,
    interleave_gemm: bool = True,
) -> dict[str, Any]:
    """The measurements of ``impl`` on ``case`` as a dict (times in ms and GEMM units, bytes).

    ``unit_ms`` is the case's GEMM unit; with ``interleave_gemm`` the CPU pairs every timed
    repetition with a GEMM instead (see ``timing.timed_units``).
    """
    device = inputs.hidden.device
    fn = impl.build(case)
    h = inputs.hidden.detach().requires_grad_(True)
    w = inputs.weight.detach().requires_grad_(True)
    step = make_step(fn, h, w, inputs)
    out: dict[str, Any] = {}

    # 1. First forward + backward: compile/warm up, and the outputs the errors are measured on.
    t0 = time.perf_counter()
    lp, ent = fn(h, w, inputs.labels)
    backward(lp, ent, inputs)
    _sync(device)
    out["first_call_s"] = time.perf_counter() - t0
    found = nonfinite(
        {"output": lp, "second output": ent, "grad_hidden": h.grad, "grad_weight": w.grad}
    )
    if found:
        out["nonfinite"] = found
    if isinstance(ref, policy.Reference):
        out["errors"] = policy.compare(ref, lp, h.grad, w.grad)
    elif ref is not None:
        out["errors"] = accuracy.compare(
            ref, lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad
        )
    del lp, ent
    gc.collect()

    # 2. Peak extra memory of one step, with .grad already allocated (from step 1).
    if measure_memory:
        if device.type == "cuda":
            out["peak_extra_bytes"] = memory.cuda_peak_extra_bytes(step, device)
        elif memory.cpu_peak_supported():
            out["peak_extra_bytes"] = memory.measure_in_subprocess(case.to_dict(), impl.spec)
        else:
            out["peak_extra_bytes"] = None
            out["peak_extra_note"] = "no resettable peak RSS on this system"

    # 3. Times.
    h0, w0 = inputs.hidden.detach(), inputs.weight.detach()

    def inference() -> None:
        with torch.no_grad():
            fn(h0, w0, inputs.labels)

    gemm = timing.gemm_fn(h0, w0) if interleave_gemm else None
    samples: list[float] = []  # every paired GEMM's ms, the forward's and the step's
    if forward:
        inference()
        _sync(device)
        t = timing.timed_units(inference, device, reps=reps, unit_ms=unit_ms, gemm=gemm)
        out["fwd_ms"], out["fwd_units"] = t["ms"], t["units"]
        samples += t.get("unit_samples", [])
    t = timing.timed_units(step, device, reps=reps, unit_ms=unit_ms, gemm=gemm)
    out["fwd_bwd_ms"], out["fwd_bwd_units"], out["unit_ms"] = t["ms"], t["units"], t["unit_ms"]
    samples += t.get("unit_samples", [])
    if gemm is not None:
        out.update(timing.unit_steadiness(samples))
    h.grad = w.grad = None
    del h, w, step
    gc.collect()
    return out


def _child(payload: str) -> int:
    """Subprocess body: inputs with allocated ``.grad``, then one measured forward + backward."""
    from fusedhead.bench import peers
    from fusedhead.bench.cases import Case, make_inputs

    data = json.loads(payload)
    case = Case.from_dict(data["case"])
    impl = peers.resolve(data["impl"])
    reason = impl.availability(case)
    if reason:
        raise SystemExit(f"{impl.name} cannot run on {case.label()}: {reason}")
    inputs = make_inputs(case)
    h = inputs.hidden.detach().requires_grad_(True)
    w = inputs.weight.detach().requires_grad_(True)
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)  # "already-allocated gradients"
    fn = impl.build(case)
    _warm_up(fn, inputs)
    if case.head == policy.NAME:  # the batch's RL terms are inputs, made before the step
        policy.terms(case, inputs.hidden, inputs.weight, inputs.labels)
    step = make_step(fn, h, w, inputs)
    extra = memory.cpu_peak_extra_bytes(step)
    print(json.dumps({"peak_extra_bytes": extra}))
    return 0


def _warm_up(fn: Callable[..., Any], inputs: Any) -> None:
    """One step on a few rows (separate leaves): thread pools and lazy state, not the case's size."""
    k = min(64, inputs.hidden.shape[0])
    small = Inputs(
        inputs.hidden[:k].clone(),
        inputs.weight,
        inputs.labels[:k].clone(),
        inputs.grad_log_probs[:k].clone(),
        inputs.grad_entropy[:k].clone(),
    )
    h = small.hidden.detach().requires_grad_(True)
    w = inputs.weight.detach().requires_grad_(True)
    make_step(fn, h, w, small)()
    del h, w, small
    gc.collect()


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1]))
