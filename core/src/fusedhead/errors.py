"""Every error the registry raises derives from ``BackendError``; each says what to do next."""

from __future__ import annotations


class BackendError(RuntimeError):
    """Base of all backend selection and loading errors."""


class UnknownBackendError(BackendError, KeyError):
    """No installed or registered backend has the configured name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MissingDependencyError(BackendError, ImportError):
    """The backend's distribution is installed but a package it needs is not."""


class BackendLoadError(BackendError):
    """Importing or instantiating the backend failed."""


class BackendConflictError(BackendError):
    """Two distributions register the same backend name."""


class IncompatibleBackendError(BackendError):
    """The backend speaks a plugin API version outside the supported window."""


class BackendUnavailableError(BackendError):
    """The backend loads but cannot run on this device or dtype; the message says why and the fix."""


class CapabilityError(BackendError):
    """A required capability is missing from the selected backend (or is not a known capability)."""
