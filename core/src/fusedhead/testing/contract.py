"""Properties of the contract's edges: ignored rows, empty and single rows, requires_grad, bad labels."""

from __future__ import annotations

from typing import Any

import torch

from fusedhead.testing.inputs import (
    FLAT,
    IGNORE_INDEX,
    TEMPERATURE,
    Case,
    make_case,
    poison_ignored,
)
from fusedhead.testing.measure import LOSS, check_against_reference, evaluate, reference, zmax
from fusedhead.testing.outcome import PropertyFailure
from fusedhead.testing.target import Target
from fusedhead.testing.tolerances import assert_close, changed_bits, same_bits


def _exactly_zero(what: str, t: torch.Tensor | None, rows: torch.Tensor) -> None:
    if t is None:
        return
    sel = t[rows]
    if sel.numel() and bool((sel != 0).any()):
        raise PropertyFailure(
            f"{what} of ignored rows must be exactly 0, got max |value| {float(sel.abs().max()):.3g}"
        )


def ignore_index(target: Target) -> None:
    """Rows whose label is ignore_index give 0 log_prob, 0 entropy and exactly zero gradient, and their hidden states (NaN, +-Inf too) reach nothing."""
    n, h, v = target.sizes.small
    for index, fraction in ((IGNORE_INDEX, 0.3), (7, 0.3), (IGNORE_INDEX, 1.0)):
        case = make_case(n, h, v, scale=FLAT, seed=9, ignore_fraction=fraction, ignore_index=index)
        case = case.to(target.device, target.dtype)
        label = f"{case.description}, ignore_index={index}, {fraction:.0%} of rows ignored"
        _ignored_rows_are_zero(target, case, index, label)
        check_against_reference(
            target, case, label=label, temperature=TEMPERATURE, ignore_index=index
        )
        dirty = poison_ignored(case, index)
        label = f"{dirty.description}, ignore_index={index}"
        _ignored_rows_are_zero(target, dirty, index, label)
        # Scored rows' values and both gradients as float64 gives them on the clean case.
        check_against_reference(
            target, case, label=label, temperature=TEMPERATURE, ignore_index=index, call_case=dirty
        )


def _ignored_rows_are_zero(target: Target, case: Case, index: int, label: str) -> None:
    """One call on ``case``: exactly 0 values and hidden-gradient rows where ignored, a finite
    weight gradient (exactly 0 when every row is ignored)."""
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    try:
        got = evaluate(target, case, target.dtype, temperature=temp, ignore_index=index)
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    ignored = case.labels == index
    try:
        _exactly_zero("log_probs", got.log_probs, ignored)
        _exactly_zero("entropy", got.entropy, ignored)
        _exactly_zero("grad hidden", got.grad_hidden, ignored)
        dw = got.grad_weight
        if dw is not None and not bool(torch.isfinite(dw).all()):
            bad = int((~torch.isfinite(dw)).sum())
            raise PropertyFailure(f"grad weight is not finite ({bad} element(s))")
        if bool(ignored.all()) and dw is not None and bool((dw != 0).any()):
            raise PropertyFailure("grad weight must be exactly 0 when every row is ignored")
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def tiny_batches(target: Target) -> None:
    """N = 0 (2-D and 3-D) gives empty fp32 outputs and zero gradients; N = 1 is right."""
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    _, h, v = target.sizes.small
    for lead in ((0,), (2, 0)):
        case = make_case(0, h, v, lead=lead).to(target.device, target.dtype)
        label = f"N=0, hidden shape {tuple(case.hidden.shape)}"
        try:
            got = evaluate(target, case, target.dtype, temperature=temp)
        except Exception as exc:
            raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
        for what, out in (("log_probs", got.log_probs), ("entropy", got.entropy)):
            if out is None or tuple(out.shape) != lead or out.dtype != torch.float32:
                got_desc = None if out is None else f"{out.dtype} {tuple(out.shape)}"
                raise PropertyFailure(
                    f"{label}: {what} must be float32 of shape {lead}, got {got_desc}"
                )
        for what, g in (("hidden", got.grad_hidden), ("weight", got.grad_weight)):
            if g is not None and bool((g != 0).any()):
                raise PropertyFailure(
                    f"{label}: grad {what} must be zero, got max {float(g.abs().max()):.3g}"
                )
    for ignore in (0.0, 1.0):
        case = make_case(1, h, v, scale=FLAT, seed=10, ignore_fraction=ignore).to(
            target.device, target.dtype
        )
        label = f"N=1 ({'ignored' if ignore else 'scored'} row), H={h} V={v}"
        check_against_reference(target, case, label=label, temperature=TEMPERATURE)


def requires_grad(target: Target) -> None:
    """Only hidden, only weight, or neither requiring grad: right values, no gradient nobody asked for."""
    n, h, v = target.sizes.small
    case = make_case(n, h, v, scale=FLAT, seed=11).to(target.device, target.dtype)
    for requires in (("hidden",), ("weight",), ()):
        label = f"{case.description}, requires_grad on {' and '.join(requires) or 'neither'}"
        got = check_against_reference(
            target, case, label=label, temperature=TEMPERATURE, requires=requires, loss=LOSS
        )
        if got.requires_grad != bool(requires):
            raise PropertyFailure(
                f"{label}: log_probs.requires_grad is {got.requires_grad}, expected {bool(requires)}"
            )
        for leaf, g in (("hidden", got.grad_hidden), ("weight", got.grad_weight)):
            if leaf not in requires and g is not None:
                raise PropertyFailure(
                    f"{label}: {leaf}.grad was set although {leaf} does not require grad"
                )

    def no_grad_call(*args: Any, **kw: Any) -> Any:
        with torch.no_grad():
            return target(*args, **kw)

    label = f"{case.description}, under torch.no_grad()"
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    got = evaluate(no_grad_call, case, target.dtype, loss=(), temperature=temp)
    want = evaluate(reference, case, torch.float64, loss=(), temperature=temp)
    if got.requires_grad:
        raise PropertyFailure(f"{label}: log_probs requires grad under torch.no_grad()")

    tol = target.tolerances(h, v, zmax(case, temperature=temp))
    try:
        assert_close("log_probs", got.log_probs, want.log_probs, tol.log_probs)
        assert want.entropy is not None
        assert_close("entropy", got.entropy, want.entropy, tol.entropy)
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def unchecked_labels(target: Target) -> None:
    """With check_labels=False, out-of-range labels give NaN log_prob for their rows, no crash, others right."""
    temp = target.allowed_temperature(TEMPERATURE)  # within the declared minimum
    n, h, v = target.sizes.small
    base = make_case(n, h, v, scale=FLAT, seed=12)
    labels = base.labels.clone()
    bad_rows = torch.tensor([1, 3, 5, 8])
    labels[bad_rows] = torch.tensor([v, v + 1_000_003, -5, 2**40])
    case = Case(base.hidden, base.weight, labels, base.description).to(target.device, target.dtype)
    label = f"{case.description}, labels {v}, {v + 1_000_003}, -5, 2**40 at rows 1, 3, 5, 8, check_labels=False"
    try:
        got = evaluate(target, case, target.dtype, loss=(), temperature=temp, check_labels=False)
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    want = evaluate(reference, case, torch.float64, loss=(), temperature=temp)
    bad = torch.zeros(n, dtype=torch.bool)
    bad[bad_rows] = True
    bad = bad.to(target.device)
    if not bool(torch.isnan(got.log_probs[bad]).all()):
        raise PropertyFailure(
            f"{label}: log_probs of out-of-range rows must be NaN, got {got.log_probs[bad].tolist()}"
        )

    good_case = Case(case.hidden[~bad], case.weight, case.labels[~bad], case.description)
    tol = target.tolerances(h, v, zmax(good_case, temperature=temp))
    assert got.entropy is not None and want.entropy is not None
    try:
        assert_close(
            "log_probs of in-range rows", got.log_probs[~bad], want.log_probs[~bad], tol.log_probs
        )
        assert_close("entropy of in-range rows", got.entropy[~bad], want.entropy[~bad], tol.entropy)
        ent_bad = got.entropy[bad]
        finite = ~torch.isnan(ent_bad)
        assert_close(
            "entropy of out-of-range rows (NaN or right)",
            ent_bad[finite],
            want.entropy[bad][finite],
            tol.entropy,
        )
    except PropertyFailure as exc:
        raise PropertyFailure(f"{label}: {exc}") from None


def inputs_unchanged(target: Target) -> None:
    """The call reads hidden, weight, labels and a per-token temperature and never writes them, forward or backward, NaN/Inf hidden states and out-of-range labels of an unchecked call included."""
    n, h, v = target.sizes.small
    case = make_case(n, h, v, scale=FLAT, seed=14, ignore_fraction=0.3)
    case = case.to(target.device, target.dtype)
    temps: list[float | torch.Tensor] = [target.allowed_temperature(TEMPERATURE)]
    if target.caps.per_token_temperature:
        per_token = torch.linspace(0.5, 2.0, n, device=target.device)
        temps.append(target.allowed_temperature(per_token))
    for temp in temps:
        kind = "per-token" if isinstance(temp, torch.Tensor) else "float"
        for grad in (True, False):
            _reads_only(target, case, temp, grad, True, f"{case.description}, {kind} temperature")
    # An unchecked call hands the backend the caller's own tensors, padding rows and all: a
    # backend that "cleans" NaN rows or clamps labels in place would write the caller's.
    dirty = poison_ignored(case)
    labels = dirty.labels.clone()
    scored = (labels.reshape(-1) != IGNORE_INDEX).nonzero().reshape(-1)[:2]
    labels.view(-1)[scored] = torch.tensor([v, -5], device=labels.device)
    dirty = Case(dirty.hidden, dirty.weight, labels, dirty.description)
    what = f"{dirty.description}, labels {v} and -5 at two rows, check_labels=False"
    for grad in (True, False):
        _reads_only(target, dirty, temps[0], grad, False, what)


def _reads_only(
    target: Target, case: Case, temp: float | torch.Tensor, grad: bool, check: bool, what: str
) -> None:
    """One call (and its backward with ``grad``) on copies of ``case``: none of them written."""
    inputs = {
        "hidden": case.hidden.detach().clone().requires_grad_(grad),
        "weight": case.weight.detach().clone().requires_grad_(grad),
        "labels": case.labels.clone(),
    }
    if isinstance(temp, torch.Tensor):
        inputs["temperature"] = temp.clone()
    before = {k: t.detach().clone() for k, t in inputs.items()}
    label = f"{what}, {'forward and backward' if grad else 'forward under no_grad'}"
    try:
        with torch.set_grad_enabled(grad):
            got = target(
                inputs["hidden"],
                inputs["weight"],
                inputs["labels"],
                temperature=inputs.get("temperature", temp),
                check_labels=check,
            )
            if grad:  # an out-of-range row's NaN log-prob sends no upstream
                loss = torch.where(torch.isfinite(got.log_probs), got.log_probs, 0).sum()
                if got.entropy is not None:
                    loss = loss + torch.where(torch.isfinite(got.entropy), got.entropy, 0).sum()
                torch.autograd.backward([loss])
    except Exception as exc:
        raise PropertyFailure(f"{label}: the call raised {type(exc).__name__}: {exc}") from exc
    for name, old in before.items():
        new = inputs[name].detach()
        if not same_bits(new, old):
            changed = changed_bits(new, old) if new.shape == old.shape else old.numel()
            raise PropertyFailure(
                f"{label}: the call wrote the caller's {name} ({changed} of "
                f"{old.numel()} values changed); a backend reads its inputs, never "
                "writes them (clone what it must change)"
            )


def fresh_outputs(target: Target) -> None:
    """Each call's outputs are its own: no two share memory, none shares an input's, and a later call leaves them as they were (a reused buffer would not)."""
    n, h, v = target.sizes.small
    temp = target.allowed_temperature(TEMPERATURE)
    cases = [
        make_case(n, h, v, scale=FLAT, seed=seed, ignore_fraction=fraction).to(
            target.device, target.dtype
        )
        for seed, fraction in ((15, 0.3), (16, 0.0), (17, 1.0))
    ]
    for grad in (False, True):
        mode = "with gradients" if grad else "under no_grad"
        kept: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        for case in cases:
            label = f"{case.description}, {mode}"
            hidden = case.hidden.detach().clone().requires_grad_(grad)
            weight = case.weight.detach().clone().requires_grad_(grad)
            try:
                with torch.set_grad_enabled(grad):
                    got = target(hidden, weight, case.labels, temperature=temp)
            except Exception as exc:
                raise PropertyFailure(
                    f"{label}: the call raised {type(exc).__name__}: {exc}"
                ) from exc
            outs = {k: t for k in ("log_probs", "entropy") if (t := getattr(got, k)) is not None}
            _own_memory(label, outs, {"hidden": hidden, "weight": weight, "labels": case.labels})
            for earlier, outs_then, values in kept:
                for k, t in outs_then.items():
                    if not torch.equal(t.detach(), values[k]):
                        raise PropertyFailure(
                            f"{earlier}: its {k} changed when a later call ran ({label}): a "
                            "backend returns fresh tensors, never a buffer it reuses"
                        )
            kept.append((label, outs, {k: t.detach().clone() for k, t in outs.items()}))


def _own_memory(label: str, outs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """No output shares memory with another output or with an input."""
    seen = {k: t.untyped_storage().data_ptr() for k, t in inputs.items()}
    for k, t in outs.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0:  # no memory (empty)
            continue
        for other, p in seen.items():
            if p == ptr:
                raise PropertyFailure(
                    f"{label}: {k} shares memory with {other}; each output is a fresh tensor"
                )
        seen[k] = ptr


CONTRACT = {
    "ignore_index": ignore_index,
    "tiny_batches": tiny_batches,
    "requires_grad": requires_grad,
    "unchecked_labels": unchecked_labels,
    "inputs_unchanged": inputs_unchanged,
    "fresh_outputs": fresh_outputs,
}
