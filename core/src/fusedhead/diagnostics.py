"""Diagnostics of the installed backends: ``fusedhead list`` rows and probes.

Selection lives in ``fusedhead.registry``; this module only reports on what it finds there (a
broken plugin gives a row with its reason, never an exception).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from fusedhead.errors import BackendContractError, BackendError
from fusedhead.registry import (
    Candidate,
    backend_capabilities,
    candidates,
    claims_allowed,
    construct_backend,
    default_device,
    error_fields,
    load_candidate,
    name_violation,
    reserved_violation,
)


class Status(str, Enum):
    """Where a backend stands; only ``ok`` and ``installed`` can be selected."""

    INSTALLED = "installed"  # found in metadata, not imported
    OK = "ok"  # imported and probed: runs here
    UNAVAILABLE = "unavailable"  # imports, but cannot run on this device/dtype
    BROKEN = "broken"  # import failed
    CONFLICT = "conflict"  # two distributions claim the name
    INCOMPATIBLE = "incompatible"  # plugin API version outside the supported window


@dataclass(frozen=True)
class BackendListing:
    """A row of ``fusedhead list``."""

    name: str
    distribution: str | None
    version: str | None
    value: str
    status: Status
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
            "status": self.status.value,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def listing(*, probe: bool = False, device: Any = None) -> list[BackendListing]:
    """Rows for ``fusedhead list``; with ``probe`` each backend is imported and checked on ``device``.

    Name-rule and reserved-name violations are shown from metadata alone; the plugin API version
    and the class's shape need the import (``probe``).
    """
    if probe and device is not None:  # the caller's device, refused as theirs: never a plugin's
        from fusedhead.checks import device_arg

        device = device_arg("device", device)
    rows: list[BackendListing] = []
    for name, claims in candidates().items():
        allowed = claims_allowed(claims)
        for c in claims:
            why = name_violation(c) or reserved_violation(c)
            if why is not None:
                status = Status.BROKEN if name_violation(c) else Status.CONFLICT
                rows.append(BackendListing(name, c.distribution, c.version, c.value, status, why))
        if len(allowed) > 1:
            why = "claimed by " + "; ".join(c.origin for c in allowed)
            for c in allowed:
                rows.append(
                    BackendListing(name, c.distribution, c.version, c.value, Status.CONFLICT, why)
                )
            continue
        if not allowed or name_violation(allowed[0]):
            continue
        first = allowed[0]
        status, reason = (Status.INSTALLED, None) if not probe else probe_backend(first, device)
        rows.append(
            BackendListing(name, first.distribution, first.version, first.value, status, reason)
        )
    return rows


def probe_backend(cand: Candidate, device: Any = None) -> tuple[Status, str | None]:
    """Import ``cand``'s class and run its ``check()`` on ``device``: its status and the reason.

    A broken plugin gives ``broken`` (or its error's status) with the reason, never an exception;
    ``device=None`` is :func:`default_device`. What ``fusedhead list --check`` and ``info`` show.
    """
    from fusedhead.errors import BackendUnavailableError

    try:
        cls = load_candidate(cand)
    except BackendError as exc:
        status = Status(exc.status) if exc.status in _STATUSES else Status.BROKEN
        return status, exc.explained
    except Exception as exc:  # a broken plugin never breaks the listing
        return Status.BROKEN, str(exc)
    try:
        import torch

        dev = torch.device(device) if device is not None else default_device()
        backend = construct_backend(cls, cls.Options(), **error_fields(cand))
        caps = backend_capabilities(backend, dev, **error_fields(cand))
        dtype = torch.float32 if "fp32" in caps.dtypes else _dtype_of(caps.dtypes[0])
        backend.check(dev, dtype)
    except BackendUnavailableError as exc:
        return Status.UNAVAILABLE, exc.attach(**error_fields(cand)).explained
    except BackendContractError as exc:  # the plugin's own bug, named by the helpers above
        return Status.BROKEN, exc.explained
    except Exception as exc:  # check() raised something else: a breach, worded as a call says it
        return Status.BROKEN, (
            f"check() raised {type(exc).__name__}: {exc}. Fix: a backend's check() must raise "
            "fusedhead.errors.BackendUnavailableError with the reason and the fix; report this "
            "to the backend's authors"
        )
    return Status.OK, None


_STATUSES = {s.value for s in Status}


def _dtype_of(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
