"""Deferred value checks: label and id ranges, per-token temperatures, a policy loss's per-token
values and counts, read by the host once.

``Pending`` collects a call's checks and reads their flags in one device-to-host copy that overlaps
the backend's kernels; under ``torch.compile`` each check is a custom op whose kernel is the eager
check, so a compiled step raises the same error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from fusedhead.checks import COUNT_FLOOR, COUNT_TEXT, RANGE_TEXT, SCALAR_HI, SCALAR_LO

#: Where ``check_labels=False`` is passed, for the errors that point to it: ``fused_policy_loss``
#: takes no such argument, a head configured with it checks none of its calls.
UNCHECKED = (
    "check_labels=False (an argument of fused_head and fused_kl; FusedHead(check_labels=False) "
    "for every call of a head, its policy_loss included)"
)


def check_temperature_values(t: torch.Tensor, arg: str, pending: Pending | None = None) -> None:
    """Every per-token temperature in ``SCALAR_RANGE`` (so finite and > 0; one device-to-host
    read, or ``pending``'s)."""
    bad = ~((t >= SCALAR_LO) & (t <= SCALAR_HI)).all()  # NaN fails both comparisons
    if pending is not None:
        pending.add(bad, _raise_bad_temperature, arg, t)
    elif bool(bad):
        _raise_bad_temperature(arg, t)


def _raise_bad_temperature(arg: str, t: torch.Tensor) -> NoReturn:
    bad = ~((t >= SCALAR_LO) & (t <= SCALAR_HI))
    idx = int(bad.nonzero()[0, 0])
    raise ValueError(
        f"{arg} tensor must hold finite values > 0 {RANGE_TEXT}, got {float(t[idx])} (as fp32) "
        f"at flat position {idx} ({int(bad.sum())} value(s) out of range)"
    )


def check_count_value(t: torch.Tensor, arg: str, pending: Pending | None = None) -> None:
    """A 0-d count (``loss_normalizer``) finite and at least ``COUNT_FLOOR`` (one device-to-host
    read, or ``pending``'s)."""
    bad = ~(torch.isfinite(t) & (t >= COUNT_FLOOR))
    if pending is not None:
        pending.add(bad, _raise_bad_count, arg, t)
    elif bool(bad):
        _raise_bad_count(arg, t)


def _raise_bad_count(arg: str, t: torch.Tensor) -> NoReturn:
    raise ValueError(
        f"{arg} must be a count > 0 (tokens or sequences), {COUNT_TEXT}, got a tensor "
        f"holding {float(t)} "
        "(a head configured with check_labels=False skips this check)"
    )


#: What ``check_labels=False`` does with an out-of-range label, as the errors say: a head's row
#: gives NaN; the KL reads labels as a mask only, so the row is scored.
HEAD_UNCHECKED_EFFECT = "such rows then give NaN"
KL_UNCHECKED_EFFECT = "such rows are then scored as any other"


def check_label_range(
    labels: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    pending: Pending | None = None,
    unchecked_effect: str = HEAD_UNCHECKED_EFFECT,
) -> torch.Tensor:
    """One device-to-host read (or ``pending``'s); the first offending position is named. Returns
    ``labels`` (under torch.compile, the checked copy from the graph's op: see ``labels_checked``)."""
    if torch.compiler.is_compiling():
        checked: torch.Tensor = labels_checked(labels, ignore_index, vocab_size, unchecked_effect)
        return checked
    bad = _bad_labels(labels, ignore_index, vocab_size)
    args = (labels, bad, ignore_index, vocab_size, unchecked_effect)
    if pending is not None:
        pending.add(bad.any(), _raise_bad_labels, *args)
    elif bool(bad.any()):
        _raise_bad_labels(*args)
    return labels


def _bad_labels(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))


def _raise_bad_labels(
    labels: torch.Tensor,
    bad: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    unchecked_effect: str = HEAD_UNCHECKED_EFFECT,
) -> NoReturn:
    idx = int(bad.nonzero()[0, 0])
    count = int(bad.sum())
    raise ValueError(
        f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}, got {int(labels[idx])} "
        f"at flat position {idx} ({count} label(s) out of range); {UNCHECKED} skips this check "
        f"({unchecked_effect})"
    )


def check_gather_range(
    flat: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    pending: Pending | None = None,
) -> None:
    """The ids that count (scored rows, not ignore_index) in range: one device-to-host read, or
    ``pending``'s."""
    counted = (labels != ignore_index).unsqueeze(1) & (flat != ignore_index)
    bad = counted & ((flat < 0) | (flat >= vocab_size))
    if pending is not None:
        pending.add(bad.any(), _raise_bad_ids, flat, bad, ignore_index, vocab_size)
    elif bool(bad.any()):
        _raise_bad_ids(flat, bad, ignore_index, vocab_size)


def _raise_bad_ids(
    flat: torch.Tensor, bad: torch.Tensor, ignore_index: int, vocab_size: int
) -> NoReturn:
    row, col = (int(i) for i in bad.nonzero()[0])
    raise ValueError(
        f"gather_ids must be in [0, {vocab_size}) or ignore_index={ignore_index} "
        f"on scored rows, got {int(flat[row, col])} at flat row {row}, position {col} "
        f"({int(bad.sum())} id(s) out of range); {UNCHECKED} skips this check (such ids then give "
        "NaN)"
    )


def check_finite_rows(
    values: dict[str, torch.Tensor], valid: torch.Tensor, pending: Pending | None = None
) -> dict[str, torch.Tensor]:
    """Each ``[N]`` fp32 tensor of ``values`` (the loss's per-token inputs, by argument name)
    finite where ``valid``: a NaN or inf there would reach the loss and every gradient, and so
    the model's weights. Ignored rows may hold anything. One device-to-host read, or
    ``pending``'s; returns ``values`` (under torch.compile, the checked copies from the graph's
    op, as ``labels_checked`` does)."""
    if not values:
        return values
    stacked = torch.stack(list(values.values()))
    if torch.compiler.is_compiling():
        checked: torch.Tensor = finite_rows_checked(stacked, valid, ",".join(values))
        return dict(zip(values, checked.unbind(0), strict=True))
    bad = (~torch.isfinite(stacked).all(0) & valid).any()
    if pending is not None:
        pending.add(bad, _raise_not_finite, values, valid)
    elif bool(bad):
        _raise_not_finite(values, valid)
    return values


def _raise_not_finite(values: dict[str, torch.Tensor], valid: torch.Tensor) -> NoReturn:
    arg, t, bad = next(
        (a, v, m) for a, v in values.items() if bool((m := ~torch.isfinite(v) & valid).any())
    )
    idx = int(bad.nonzero()[0, 0])
    value = float(t[idx])
    why = " (inf also where an fp64 value passes fp32's range, 3.4e38)" if math.isinf(value) else ""
    raise ValueError(
        f"{arg} must be finite on scored rows (label != ignore_index), got {value} (as fp32) at "
        f"flat position {idx} ({int(bad.sum())} such value(s)){why}; give a row whose value is "
        f"unknown the label ignore_index, or {UNCHECKED} skips this check (the loss and both "
        "gradients are then NaN or inf)"
    )


class Pending:
    """A call's value checks (label and id ranges, per-token temperatures, a policy loss's values)
    and counts, read by the host in one go.

    Each check adds its flag, computed where the tensors are. On CUDA, ``send`` (just before the
    backend's ``forward``) copies the flags to pinned host memory behind an event, and ``settle``
    (after ``forward`` has queued the head's kernels) waits for that event only, then raises the
    first failed check's error, so the GPU never idles while the host waits for a check. That is
    safe because a backend must be memory-safe on out-of-range values anyway (``check_labels=False``
    gives NaN rows). Elsewhere ``send`` reads the flags at once, before the backend sees the call.
    """

    __slots__ = ("_checks", "_counts", "_event", "_host", "counts")

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[..., NoReturn], tuple[Any, ...]]] = []
        self._counts: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self._event: Any = None
        #: The values of the counts ``count`` added, in order, once ``settle`` has read them.
        self.counts: list[int] = []

    def add(self, bad: torch.Tensor, raiser: Callable[..., NoReturn], *args: Any) -> None:
        """A 0-d bool ``bad``; ``raiser(*args)`` raises the check's error when it is set."""
        self._checks.append((bad, raiser, args))

    def count(self, value: torch.Tensor) -> None:
        """A 0-d integer tensor read with the flags (no read of its own): ``counts`` after
        ``settle``."""
        self._counts.append(value)

    def any_failed(self) -> torch.Tensor | None:
        """A 0-d bool on the checks' device, set where any check failed (None: no check)."""
        checks = self._checks
        if not checks:
            return None
        return checks[0][0] if len(checks) == 1 else torch.stack([c[0] for c in checks]).any()

    def send(self) -> None:
        """Start the flags' one read (CUDA: queued behind an event), or raise now (elsewhere)."""
        checks = self._checks
        if not checks and not self._counts:
            return
        if self._counts:
            flags = torch.stack([c[0].to(torch.int64) for c in checks] + self._counts)
        else:
            flags = checks[0][0] if len(checks) == 1 else torch.stack([c[0] for c in checks])
        if flags.device.type != "cuda":
            self._host = flags
            self.settle()
            return
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "check_labels=True checks the label range (and any gather_ids, per-token "
                "temperature tensor and a policy loss's per-token values) by a device-to-host "
                f"read, which CUDA-graph capture forbids; inside a captured region, {UNCHECKED} "
                "skips every value check"
            )
        self._host = flags.to("cpu", non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(flags.device))

    def settle(self) -> None:
        """Wait for the flags (not for the head's kernels) and raise the first failed check's error."""
        host = self._host
        if host is None:
            return
        self._host = None
        if self._event is not None:
            self._event.synchronize()
        read = host.tolist()
        read = read if isinstance(read, list) else [read]
        failed, self.counts = read[: len(self._checks)], [int(c) for c in read[len(self._checks) :]]
        for bad, (_, raiser, args) in zip(failed, self._checks, strict=True):
            if bad:
                raiser(*args)


# While torch.compile traces, a check cannot read a tensor's values: that is a data-dependent
# branch, which breaks the graph. Each check above is then one opaque custom op whose kernel is
# the eager check, so a compiled step raises the very same ValueError (and pays the same host
# sync). The op hands its input back as a copy that the call goes on with: an op whose output
# nothing reads would be dropped from the graph as dead code. (``torch._assert_async`` is no
# substitute: inductor's CPU kernels throw its error inside OpenMP regions, which aborts.)


@torch.library.custom_op("fusedhead::check_labels", mutates_args=())
def labels_checked(
    labels: torch.Tensor, ignore_index: int, vocab_size: int, unchecked_effect: str
) -> torch.Tensor:
    """``check_label_range`` in a compiled graph; a copy of ``labels``."""
    check_label_range(labels, ignore_index, vocab_size, None, unchecked_effect)
    return labels.clone()


@torch.library.custom_op("fusedhead::check_temperature", mutates_args=())
def temperature_checked(t: torch.Tensor, arg: str) -> torch.Tensor:
    """``check_temperature_values`` in a compiled graph; a copy of ``t``."""
    check_temperature_values(t, arg)
    return t.clone()


@torch.library.custom_op("fusedhead::check_gather_ids", mutates_args=())
def gather_ids_checked(
    flat: torch.Tensor, labels: torch.Tensor, ignore_index: int, vocab_size: int
) -> torch.Tensor:
    """``check_gather_range`` in a compiled graph; a copy of ``flat``."""
    check_gather_range(flat, labels, ignore_index, vocab_size)
    return flat.clone()


@torch.library.custom_op("fusedhead::check_count", mutates_args=())
def count_checked(t: torch.Tensor, arg: str) -> torch.Tensor:
    """``check_count_value`` in a compiled graph; a copy of ``t``."""
    check_count_value(t, arg)
    return t.clone()


@torch.library.custom_op("fusedhead::check_finite_rows", mutates_args=())
def finite_rows_checked(stacked: torch.Tensor, valid: torch.Tensor, names: str) -> torch.Tensor:
    """``check_finite_rows`` in a compiled graph, on its values stacked ``[k, N]`` (``names``
    joined by commas); a copy of ``stacked``."""
    check_finite_rows(dict(zip(names.split(","), stacked.unbind(0), strict=True)), valid)
    return stacked.clone()


@finite_rows_checked.register_fake
@labels_checked.register_fake
@temperature_checked.register_fake
@gather_ids_checked.register_fake
@count_checked.register_fake
def _checked_copy(t: torch.Tensor, *_: object) -> torch.Tensor:
    """What the five ops give while tracing: a tensor like their first input."""
    return torch.empty_like(t)
