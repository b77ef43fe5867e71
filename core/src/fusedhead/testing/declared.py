"""Properties a backend may declare: determinism, batch invariance, per-token temperature, softcap.

A capability that is not declared is not run; one that is declared and found false is a failure.
"""

from __future__ import annotations

import math

import torch

from fusedhead.testing.inputs import FLAT, PEAKED, TEMPERATURE, Case, make_case
from fusedhead.testing.interpreter import unless_interpreter_dot_varies
from fusedhead.testing.measure import Outputs, check_against_reference, evaluate
from fusedhead.testing.outcome import NotRun, PropertyFailure
from fusedhead.testing.target import Target


def _declared(target: Target, capability: str) -> None:
    if not getattr(target.caps, capability, False):
        raise NotRun(f"the backend does not declare {capability} on {target.device.type}")


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    flat = diff.reshape(-1).nonzero()
    if flat.numel() == 0:
        return "no difference"
    i = int(flat[0, 0])
    row = i // (math.prod(a.shape[1:]) or 1)
    return (
        f"{int(diff.sum())} element(s) differ, first at row {row}: "
        f"{a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}"
    )


def _bitwise(what: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            raise PropertyFailure(f"{what}: one run returned None, the other a tensor")
        return
    if a.shape != b.shape or not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
        raise PropertyFailure(f"{what} not bitwise equal: {_first_difference(a, b)}")


def determinism(target: Target) -> None:
    """If declared: two runs of forward and backward give bitwise equal outputs and gradients."""
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    _declared(target, "deterministic")
    n, h, v = target.sizes.main
    for scale in (FLAT, PEAKED):
        case = make_case(n, h, v, scale=scale, seed=13).to(target.device, target.dtype)
        runs = [evaluate(target, case, target.dtype, temperature=temp) for _ in range(2)]
        for field in ("log_probs", "entropy", "grad_hidden", "grad_weight"):
            _bitwise(
                f"{case.description}: {field} of two identical runs",
                getattr(runs[0], field),
                getattr(runs[1], field),
            )


def _forward(
    target: Target, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> Outputs:
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    case = Case(hidden, weight, labels, "")
    return evaluate(target, case, target.dtype, loss=(), temperature=temp)


@unless_interpreter_dot_varies
def batch_invariance(target: Target) -> None:
    """If declared: a row's forward outputs are bitwise equal alone, in a permuted, sliced or larger batch."""
    _declared(target, "batch_invariant")
    n, h, v = target.sizes.main
    dev = target.device
    case = make_case(n, h, v, scale=FLAT, seed=14).to(dev, target.dtype)
    extra = make_case(3 * n + 5, h, v, scale=FLAT, seed=15).to(dev, target.dtype)
    hid, w, y = case.hidden, case.weight, case.labels
    full = _forward(target, hid, w, y)
    everything = torch.arange(n, device=dev)
    # (description, rows of the full batch fed in order, where those rows sit in the output)
    layouts: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    ignored = int((y == -100).nonzero()[0, 0]) if bool((y == -100).any()) else 0
    for row in sorted({0, 1, n // 2, n - 1, ignored}):
        layouts.append((f"row {row} alone (N=1)", everything[row : row + 1], None))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(16)).to(dev)
    layouts.append(("the batch permuted", perm, None))
    for lo, hi in ((5, n // 2 + 3), (n - 3, n)):
        layouts.append((f"rows {lo}:{hi} as a batch", everything[lo:hi], None))
    layouts.append(
        (
            f"the batch inside a batch of {4 * n + 5} rows",
            everything,
            torch.arange(7, 7 + n, device=dev),
        )
    )
    for description, rows, where in layouts:
        if where is None:
            out = _forward(target, hid[rows], w, y[rows])
            where = torch.arange(len(rows), device=dev)
        else:
            big_h = torch.cat([extra.hidden[:7], hid, extra.hidden[7:]])
            big_y = torch.cat([extra.labels[:7], y, extra.labels[7:]])
            out = _forward(target, big_h, w, big_y)
        what = f"{case.description}: {{}} of {description} vs the full batch"
        _bitwise(what.format("log_probs"), out.log_probs[where], full.log_probs[rows])
        if full.entropy is not None and out.entropy is not None:
            _bitwise(what.format("entropy"), out.entropy[where], full.entropy[rows])


def per_token_temperature(target: Target) -> None:
    """If declared: a temperature tensor (one per token, 0.05 (or the declared min_temperature) to 20; broadcast in 3-D) matches float64."""
    _declared(target, "per_token_temperature")
    n, h, v = target.sizes.small
    low, high = target.temperature_range(0.05, 20.0)
    g = torch.Generator().manual_seed(17)
    temps = torch.exp(torch.empty(n).uniform_(math.log(low), math.log(high), generator=g))
    temps = target.allowed_temperature(temps).to(target.device)  # exp(log(low)) may round below
    case = make_case(n, h, v, scale=FLAT, seed=18).to(target.device, target.dtype)
    check_against_reference(
        target,
        case,
        label=f"{case.description}, per-token temperatures in [{low:g}, {high:g}]",
        temperature=temps,
    )
    b = 4
    case3 = make_case(n, h, v, scale=PEAKED, seed=19, lead=(b, n // b)).to(
        target.device, target.dtype
    )
    per_seq = torch.tensor([0.5, 1.0, 2.0, 0.7], device=target.device).reshape(b, 1)
    check_against_reference(
        target,
        case3,
        label=f"{case3.description}, 3-D, temperature [B, 1] broadcast per sequence",
        temperature=per_seq,
    )


def softcap(target: Target) -> None:
    """If declared: ``z = c * tanh((h @ W.T) / c) / temperature`` matches float64, forward and backward."""
    _declared(target, "softcap")
    n, h, v = target.sizes.small
    for cap, temp in ((5.0, TEMPERATURE), (30.0, 1.3), (2.0, 0.1)):
        case = make_case(n, h, v, scale=PEAKED, seed=20).to(target.device, target.dtype)
        check_against_reference(
            target,
            case,
            label=f"{case.description}, softcap {cap}, temperature {temp}",
            temperature=temp,
            softcap=cap,
        )


DECLARED = {
    "determinism": determinism,
    "batch_invariance": batch_invariance,
    "per_token_temperature": per_token_temperature,
    "softcap": softcap,
}
