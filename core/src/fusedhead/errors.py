"""Every error about a backend derives from ``BackendError`` and carries its facts as fields.

The message is built from the fields (``backend``, ``distribution``, ``version``, ``reason``,
``hint``), so the CLI, ``--json`` and callers read the fields instead of parsing text. A backend
raises with a ``reason`` (and a ``hint``); the core fills in who it is when the error passes
through it (:meth:`BackendError.attach`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar


class BackendError(RuntimeError):
    """Base of all backend selection, loading and contract errors."""

    #: What ``fusedhead list`` and ``--json`` show for a backend that raised this.
    status: ClassVar[str] = "error"

    def __init__(
        self,
        reason: str,
        *,
        backend: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
        hint: str | None = None,
    ) -> None:
        # Not ``super().__init__(reason)``: Dynamo cannot trace that call into the builtin base's
        # __init__, so a refusal raised while torch.compile traces a call (a capability the
        # backend lacks) became Dynamo's error about super(). What that __init__ does, plainly.
        self.args = (reason,)
        self.reason = reason
        self.backend = backend
        self.distribution = distribution
        self.version = version
        self.hint = hint

    def attach(
        self, *, backend: str | None, distribution: str | None, version: str | None
    ) -> BackendError:
        """Fill in the backend's identity where the raiser left it out; returns ``self``."""
        if self.backend is None:
            self.backend = backend
        if self.distribution is None:
            self.distribution = distribution
            if self.version is None:
                self.version = version
        return self

    @property
    def where(self) -> str:
        """``backend 'name' (distribution version)``, or '' when no backend is known."""
        if self.backend is None:
            return ""
        text = f"backend {self.backend!r}"
        if self.distribution is not None:
            text += f" ({self.distribution}" + (f" {self.version})" if self.version else ")")
        return text

    @property
    def explained(self) -> str:
        """The reason as a sentence, then the fix where there is one (no backend named)."""
        return _with_fix(self.reason, self.hint)

    @property
    def message(self) -> str:
        """The message built from the fields: who, why, and the fix."""
        return _with_fix(f"{self.where}: {self.reason}" if self.where else self.reason, self.hint)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The fields, for ``--json`` and logs."""
        return {
            "error": type(self).__name__,
            "status": self.status,
            "backend": self.backend,
            "distribution": self.distribution,
            "version": self.version,
            "reason": self.reason,
            "hint": self.hint,
            "message": self.message,
        }


class UnknownBackendError(BackendError, KeyError):
    """No installed or registered backend has the configured name."""

    status = "unknown"

    @property
    def where(self) -> str:  # the reason names the unknown backend itself
        return ""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class MissingDependencyError(BackendError, ImportError):
    """The backend's distribution is installed but a package it needs is not."""

    status = "broken"

    def __init__(self, reason: str, *, missing: str | None = None, **fields: Any) -> None:
        BackendError.__init__(self, reason, **fields)
        #: The top-level package that could not be imported, when known.
        self.missing = missing

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "missing": self.missing}


class BackendLoadError(BackendError):
    """Importing the backend failed, or its class does not have the shape the plugin API asks."""

    status = "broken"


class BackendConflictError(BackendError):
    """Two distributions claim one backend name, or a reserved name comes from a third party."""

    status = "conflict"

    def __init__(self, reason: str, *, claimants: tuple[str, ...] = (), **fields: Any) -> None:
        super().__init__(reason, **fields)
        #: Each claim's origin, ``distribution version (module:Class)``.
        self.claimants = claimants

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "claimants": list(self.claimants)}


class IncompatibleBackendError(BackendError):
    """The backend speaks a plugin API version outside the supported window."""

    status = "incompatible"


class BackendUnavailableError(BackendError):
    """The backend loads but cannot run on this device or dtype; says why and the fix."""

    status = "unavailable"


class CapabilityError(BackendError):
    """The call or ``require=[...]`` asks for a capability the backend does not declare."""

    status = "missing-capability"

    def __init__(self, reason: str, *, capability: str | None = None, **fields: Any) -> None:
        super().__init__(reason, **fields)
        #: The capability that is missing, when one is named.
        self.capability = capability

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "capability": self.capability}


class BackendContractError(BackendError):
    """A backend broke the plugin contract at run time (wrong outputs, a raw exception from check)."""

    status = "broken"


class OptionsError(BackendError, ValueError):
    """A backend's options do not validate: names the option, the value, what was expected and
    every valid option of that backend (``name: type = default``)."""

    status = "invalid-options"

    def __init__(
        self,
        reason: str,
        *,
        option: str | None = None,
        expected: str | None = None,
        valid_options: Sequence[str] = (),
        **fields: Any,
    ) -> None:
        super().__init__(reason, **fields)
        #: The first offending option's name, when one is named.
        self.option = option
        #: What that option takes, e.g. ``int > 0 or None``.
        self.expected = expected
        #: Every option of the backend as ``name: type = default``.
        self.valid_options = tuple(valid_options)

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "option": self.option,
            "expected": self.expected,
            "valid_options": list(self.valid_options),
        }


#: Every error class, for docs and tests.
ERROR_CLASSES: tuple[type[BackendError], ...] = (
    BackendError,
    UnknownBackendError,
    MissingDependencyError,
    BackendLoadError,
    BackendConflictError,
    IncompatibleBackendError,
    BackendUnavailableError,
    CapabilityError,
    BackendContractError,
    OptionsError,
)


def note_backend(
    exc: BaseException, backend: str | None, distribution: str | None, version: str | None
) -> None:
    """Name the backend an exception of its own came from (an IndexError, an out-of-memory),
    without changing its type: a note shown under the traceback (Python 3.11+)."""
    add_note = getattr(exc, "add_note", None)
    if callable(add_note):
        where = f"{distribution} {version}" if distribution else "registered in-process"
        add_note(f"raised inside fusedhead backend {backend!r} ({where})")


def _with_fix(text: str, hint: str | None) -> str:
    """``text`` ended as a sentence and followed by ``Fix: hint``; ``text`` alone without one."""
    if not hint:
        return text
    return text + ("" if text.endswith((".", "!", "?", ":", ";")) else ".") + f" Fix: {hint}"


def type_name(value: object) -> str:
    """``value``'s type for a message: a builtin's name, any other's module too (``numpy.bool``,
    whose bare name "bool" made "must be a bool, got bool np.True_")."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def exception_text(exc: BaseException) -> str:
    """``Type: message`` on one line; a pydantic ``ValidationError`` as each field's error."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        errors = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ())) or "(the model)"
            value = repr(err.get("input"))
            value = value if len(value) <= 60 else value[:57] + "..."
            errors.append(f"{where}: {err.get('msg')} (got {value})")
        return f"ValidationError building {exc.title}: " + "; ".join(errors)
    return " ".join(f"{type(exc).__name__}: {exc}".split())
