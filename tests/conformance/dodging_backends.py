"""In-process backends that break the kit's own rules: one raises the kit's NotRun (or
PropertyFailure) from inside a call, one leaves ignored rows in the sum (``0 * NaN``).

Importable by module name: the kit's spawned vocab-parallel ranks re-register the class.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from kit_backends import KitRef, _Plain, register, unregister

from fusedhead.protocol import HeadCall, HeadOutput
from fusedhead.testing import NotRun, PropertyFailure


class _Raise(torch.autograd.Function):
    """Identity forward; raises ``error`` in backward (a backward the kit drives through autograd)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, error: Exception) -> torch.Tensor:
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise ctx.error


class NotRunInForward(KitRef):
    """Declares everything but the extras; raises the kit's NotRun from every forward."""

    name: ClassVar[str] = "dodge-notrun-forward"
    declared: ClassVar[dict[str, Any]] = {**KitRef.declared, "batch_invariant": True}
    error: ClassVar[type[Exception]] = NotRun

    def forward(self, call: HeadCall) -> HeadOutput:
        raise self.error("not applicable")


class FailureInForward(NotRunInForward):
    """The same with the kit's PropertyFailure (which the interpreter's decorator turns into NotRun)."""

    name: ClassVar[str] = "dodge-failure-forward"
    error: ClassVar[type[Exception]] = PropertyFailure


class NotRunInBackward(NotRunInForward):
    """Right values; raises the kit's NotRun from the backward autograd runs."""

    name: ClassVar[str] = "dodge-notrun-backward"

    def forward(self, call: HeadCall) -> HeadOutput:
        out = KitRef.forward(self, call)
        return HeadOutput(_Raise.apply(out.log_probs, NotRun("not applicable")), out.entropy)


class UnmaskedIgnoredRows(_Plain):
    """Wrong: ignored rows are computed, then replaced by 0 (``where``): exactly 0 values, but the
    softmax's backward at a NaN or Inf row is NaN, which reaches dh and dW."""

    name: ClassVar[str] = "wrong-unmasked-ignored-rows"

    def single(self, hidden, weight, labels, temperature, ignore_index, return_entropy, softcap):  # type: ignore[no-untyped-def]
        valid = labels != ignore_index
        lp, ent = super().single(
            hidden, weight, torch.where(valid, labels, 0), temperature, -1, True, softcap
        )
        return torch.where(valid, lp, 0.0), (
            torch.where(valid, ent, 0.0) if return_entropy else None
        )


class WrongOnlyOnce(KitRef):
    """Wrong in its first forward alone (log-probs off by 0.5), right ever after: a backend
    whose results differ from run to run on the same inputs, as hypothesis's replay sees it."""

    name: ClassVar[str] = "wrong-only-once"

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self.calls = 0

    def forward(self, call: HeadCall) -> HeadOutput:
        out = KitRef.forward(self, call)
        self.calls += 1
        if self.calls > 1:
            return out
        return HeadOutput(out.log_probs + 0.5, out.entropy)


ALL: tuple[type, ...] = (
    NotRunInForward,
    FailureInForward,
    NotRunInBackward,
    UnmaskedIgnoredRows,
    WrongOnlyOnce,
)


def register_all() -> None:
    register(ALL)


def unregister_all() -> None:
    unregister(ALL)
