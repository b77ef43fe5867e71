"""What one property of the conformance kit reports: pass, fail, or not run, with the reason."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    """The three answers a property can give."""

    PASS = "pass"
    FAIL = "fail"
    NOT_RUN = "not run"


@dataclass(frozen=True)
class Result:
    """The outcome of one property on one (backend, options, device, dtype), with a one-line reason."""

    name: str
    outcome: Outcome
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True unless the property failed (a property that did not run is not a failure)."""
        return self.outcome is not Outcome.FAIL

    def line(self) -> str:
        """``PASS name``, ``FAIL name: why`` or ``NOT RUN name: why``."""
        head = f"{self.outcome.value.upper()} {self.name}"
        return f"{head}: {self.message}" if self.message else head


class PropertyFailure(AssertionError):
    """Raised inside a property when the backend breaks the contract; the message says how."""


class NotRun(Exception):
    """Raised inside a property that cannot be checked here (capability not declared, no GPU...)."""
