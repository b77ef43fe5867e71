"""Properties of accuracy against the float64 reference: shapes, temperatures, layouts, extremes."""

from __future__ import annotations

import torch

from fusedhead.errors import CapabilityError
from fusedhead.protocol import SCALAR_RANGE
from fusedhead.testing.inputs import FLAT, PEAKED, TEMPERATURE, Case, make_case
from fusedhead.testing.measure import LOSS, Views, check_against_reference
from fusedhead.testing.outcome import PropertyFailure
from fusedhead.testing.target import Target

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def forward_accuracy(target: Target) -> None:
    """log_probs and entropy match float64 on flat and peaked inputs at temperature 0.7."""
    n, h, v = target.sizes.main
    for scale in (FLAT, PEAKED):
        case = make_case(n, h, v, scale=scale, seed=1).to(target.device, target.dtype)
        check_against_reference(target, case, temperature=TEMPERATURE, loss=())


def backward_accuracy(target: Target) -> None:
    """Gradients of hidden and weight match float64, upstream through log_probs, entropy, and both."""
    n, h, v = target.sizes.main
    for scale in (FLAT, PEAKED):
        case = make_case(n, h, v, scale=scale, seed=2).to(target.device, target.dtype)
        for loss in (("log_probs",), ("entropy",), LOSS):
            label = f"{case.description}, upstream gradient through {' and '.join(loss)} only"
            if len(loss) == 2:
                label = f"{case.description}, upstream gradient through both outputs"
            check_against_reference(target, case, label=label, temperature=TEMPERATURE, loss=loss)


def without_entropy(target: Target) -> None:
    """``return_entropy=False`` gives entropy None, the same log_probs, and right gradients."""
    n, h, v = target.sizes.small
    case = make_case(n, h, v, scale=PEAKED, seed=3).to(target.device, target.dtype)
    check_against_reference(
        target,
        case,
        label=f"{case.description}, return_entropy=False",
        temperature=TEMPERATURE,
        return_entropy=False,
        loss=("log_probs",),
    )


def temperature(target: Target) -> None:
    """Forward and backward match float64 for temperatures from 0.05 (or the declared min_temperature) to 20; one below a declared min_temperature is refused."""
    n, h, v = target.sizes.small
    low, high = target.temperature_range(0.05, 20.0)
    flat = sorted({target.allowed_temperature(t) for t in (0.05, 0.3, 1.0, 3.0, 20.0)})
    peaked = sorted({low, high})
    settings = [(FLAT, t) for t in flat] + [(PEAKED, t) for t in peaked]
    for scale, temp in settings:
        case = make_case(n, h, v, scale=scale, seed=4).to(target.device, target.dtype)
        check_against_reference(
            target, case, label=f"{case.description}, temperature {temp:g}", temperature=temp
        )
    case = make_case(n, h, v, scale=FLAT, seed=4).to(target.device, target.dtype)
    _below_min_temperature_is_refused(target, case)


def _below_min_temperature_is_refused(target: Target, case: Case) -> None:
    """A declared ``min_temperature`` is a promise both ways: below it, a ``CapabilityError``
    naming it, never a value computed anyway (a float, and a per-token tensor if declared)."""
    floor = target.min_temperature
    if floor <= SCALAR_RANGE[0]:  # nothing declared: the core's own range is the floor
        return
    below = max(floor / 2, SCALAR_RANGE[0])  # below the floor, within the core's own range
    hidden, weight, labels = case.hidden, case.weight, case.labels
    temps: list[float | torch.Tensor] = [below]
    if target.caps.per_token_temperature:
        per_token = torch.full(labels.shape, floor, device=target.device)
        per_token[0] = below
        temps.append(per_token)
    for temp in temps:
        what = (
            f"a per-token temperature with one value {below:g}"
            if isinstance(temp, torch.Tensor)
            else f"temperature {below:g}"
        )
        where = f"{case.description}, {what} below the declared min_temperature {floor:g}"
        try:
            with torch.no_grad():
                target(hidden, weight, labels, temperature=temp)
        except CapabilityError as exc:
            if exc.capability != "min_temperature":
                raise PropertyFailure(
                    f"{where}: refused for capability {exc.capability!r}, expected "
                    f"'min_temperature': {exc}"
                ) from exc
            continue
        except Exception as exc:
            raise PropertyFailure(
                f"{where}: expected CapabilityError, the call raised {type(exc).__name__}: {exc}"
            ) from exc
        raise PropertyFailure(f"{where}: computed, expected a CapabilityError refusing it")


def odd_shapes(target: Target) -> None:
    """V and H that are multiples of no tile size (V = 1000 + 37, H = 100 + 3, tiny ones) are right."""
    for i, (n, h, v) in enumerate(target.sizes.odd):
        case = make_case(n, h, v, scale=FLAT, seed=5 + i).to(target.device, target.dtype)
        check_against_reference(target, case, temperature=TEMPERATURE)


def _layouts() -> list[tuple[str, int, Views]]:
    """(description, rows factor, views) for each layout; views map contiguous leaves to the call."""

    def three_d(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h.reshape(4, -1, h.shape[-1]), w, y.reshape(4, -1)

    def seq_first(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        s = h.shape[0] // 4
        return h.reshape(s, 4, h.shape[-1]).transpose(0, 1), w, y.reshape(s, 4).T

    def every_other_row(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h[::2], w, y[::2]

    def hidden_column_major(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h.T.contiguous().T, w, y

    def hidden_in_wider_rows(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return torch.cat([h, h], dim=1)[:, : h.shape[1]], w, y

    def weight_column_major(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h, w.T.contiguous().T, y

    def weight_strided_rows(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h, torch.stack([w, torch.zeros_like(w)], dim=1).reshape(-1, w.shape[1])[::2], y

    def labels_int32_strided(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Triple:
        return h, w, torch.stack([y, y], dim=1).to(torch.int32)[:, 0]

    return [
        ("3-D hidden [B, S, H] with labels [B, S]", 1, three_d),
        ("3-D hidden transposed from [S, B, H] (non-contiguous)", 1, seq_first),
        ("every other row of hidden and labels (row stride 2H)", 2, every_other_row),
        ("column-major hidden", 1, hidden_column_major),
        ("hidden sliced from wider rows", 1, hidden_in_wider_rows),
        ("column-major weight", 1, weight_column_major),
        ("weight rows with stride 2H", 1, weight_strided_rows),
        ("int32 labels with stride 2", 1, labels_int32_strided),
    ]


def input_layouts(target: Target) -> None:
    """3-D and non-contiguous hidden, weight and labels give the right values, shapes and gradients."""
    n, h, v = target.sizes.small
    for description, factor, views in _layouts():
        case = make_case(n * factor, h, v, scale=FLAT, seed=6).to(target.device, target.dtype)
        check_against_reference(
            target,
            case,
            label=f"{case.description}, {description}",
            temperature=TEMPERATURE,
            views=views,
        )


def _argmax_labels(case: Case, rows: int) -> Case:
    """The case with its first ``rows`` labels set to each row's most likely token."""
    z = case.hidden.double() @ case.weight.double().T
    labels = case.labels.clone()
    labels[:rows] = z[:rows].argmax(-1)
    return Case(case.hidden, case.weight, labels, case.description)


def extreme_logits(target: Target) -> None:
    """Logits of magnitude ~3000 and logits that are all below -300 give finite, right values."""
    n, h, v = target.sizes.small
    large = _argmax_labels(make_case(n, h, v, scale=500.0, seed=7), rows=4)
    check_against_reference(
        target,
        large.to(target.device, target.dtype),
        label=f"large-magnitude logits (|z| up to ~3000), {large.description}",
        temperature=TEMPERATURE,
    )
    base = make_case(n, h, v, scale=PEAKED, seed=8)
    hidden = torch.cat([base.hidden, torch.ones(n, 1)], dim=1)
    weight = torch.cat([base.weight, torch.full((v, 1), -250.0)], dim=1)
    negative = Case(
        hidden,
        weight,
        base.labels,
        f"all-negative logits (z in about [-390, -320]), N={n} H={h + 1} V={v}",
    )
    check_against_reference(
        target, negative.to(target.device, target.dtype), temperature=TEMPERATURE
    )


ACCURACY = {
    "forward_accuracy": forward_accuracy,
    "backward_accuracy": backward_accuracy,
    "without_entropy": without_entropy,
    "temperature": temperature,
    "odd_shapes": odd_shapes,
    "input_layouts": input_layouts,
    "extreme_logits": extreme_logits,
}
