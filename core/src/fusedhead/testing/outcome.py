"""What one property of the conformance kit reports: pass, fail, or not run, with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
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


#: The exceptions the kit raises to report a property; a backend never raises them.
KIT_EXCEPTIONS = (NotRun, PropertyFailure)
_KIT_DIR = os.path.realpath(os.path.dirname(__file__)) + os.sep
#: Code that runs the kit's own functions (hypothesis calls the randomized cases back).
_KIT_DRIVERS = (f"{os.sep}hypothesis{os.sep}",)


def _kit_frame(filename: str) -> bool:
    """True for a frame of the kit itself (or of hypothesis, which calls the kit's cases back)."""
    path = os.path.realpath(filename)
    return path.startswith(_KIT_DIR) or any(d in path for d in _KIT_DRIVERS)


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or during (``from None`` hides, not drops, a context)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _through_other_code(exc: BaseException) -> bool:
    """True when ``exc`` came up through a frame the kit does not own (the backend, the core, torch)."""
    tb = exc.__traceback__
    while tb is not None:
        if not _kit_frame(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


def raised_by_backend(exc: BaseException) -> Exception | None:
    """The kit's own NotRun or PropertyFailure in ``exc``'s chain that came out of a call into the
    backend (not raised by the kit itself), if any: a backend must not report its own verdict."""
    for cause in exception_chain(exc):
        if isinstance(cause, KIT_EXCEPTIONS) and _through_other_code(cause):
            return cause
    return None
