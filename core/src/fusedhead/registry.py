"""The backend registry: entry-point discovery by metadata, selection by exact name, lazy import.

Discovery reads distribution metadata only (no backend module is imported) and is cached per
process. A backend is imported when, and only when, its exact configured name is selected. There is
no priority, no autodetection and no fallback: an unknown name is an error that lists what is there.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata as md
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from fusedhead.errors import (
    BackendConflictError,
    BackendLoadError,
    IncompatibleBackendError,
    MissingDependencyError,
    UnknownBackendError,
)

ENTRY_POINT_GROUP = "fusedhead.backends"
NAME_PATTERN = re.compile(r"^[a-z0-9_-]+$")
#: Environment variable limiting discovery to a comma-separated list of names.
LIMIT_ENV = "FUSEDHEAD_BACKENDS"
#: First-party backends and the extra that installs each.
FIRST_PARTY_EXTRAS = {
    "torch": "fusedhead[torch]",
    "triton": "fusedhead[triton]",
    "liger": "fusedhead[liger]",
}


class Status(str, Enum):
    """Where a backend stands; only ``ok`` and ``installed`` can be selected."""

    INSTALLED = "installed"  # found in metadata, not imported
    OK = "ok"  # imported and probed: runs here
    UNAVAILABLE = "unavailable"  # imports, but cannot run on this device/dtype
    BROKEN = "broken"  # import failed
    CONFLICT = "conflict"  # two distributions claim the name
    INCOMPATIBLE = "incompatible"  # plugin API version outside the supported window


@dataclass(frozen=True)
class Candidate:
    """One claim on a backend name: an entry point of a distribution, or an in-process class."""

    name: str
    value: str
    distribution: str | None = None
    version: str | None = None
    entry_point: md.EntryPoint | None = field(default=None, compare=False, repr=False)
    cls: type[Any] | None = field(default=None, compare=False, repr=False)

    @property
    def origin(self) -> str:
        if self.distribution is None:
            return f"registered in-process ({self.value})"
        return f"{self.distribution} {self.version} ({self.value})"


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


_registered: dict[str, Candidate] = {}


def _normalize(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _limit() -> set[str] | None:
    raw = os.environ.get(LIMIT_ENV)
    if raw is None or not raw.strip():
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


@functools.lru_cache(maxsize=1)
def _discover_entry_points() -> tuple[Candidate, ...]:
    """All entry points of the group, one per (distribution, name); same dist twice is one."""
    seen: set[tuple[str, str]] = set()
    found: list[Candidate] = []
    for dist in md.distributions():
        eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        if not eps:
            continue
        dist_name = dist.metadata["Name"] or "unknown"
        for ep in eps:
            key = (_normalize(dist_name), ep.name)
            if key in seen:  # the same distribution seen twice on sys.path
                continue
            seen.add(key)
            found.append(Candidate(ep.name, ep.value, dist_name, dist.version, entry_point=ep))
    return tuple(sorted(found, key=lambda c: (c.name, _normalize(c.distribution or ""))))


def refresh() -> None:
    """Forget cached discovery (after installing or removing a distribution in this process)."""
    _discover_entry_points.cache_clear()
    _load_class.cache_clear()
    importlib.invalidate_caches()
    clear = getattr(getattr(getattr(md, "FastPath", None), "__new__", None), "cache_clear", None)
    if clear is not None:  # importlib.metadata caches directory listings
        clear()


def candidates() -> dict[str, list[Candidate]]:
    """Every claim on every name, honouring ``FUSEDHEAD_BACKENDS``; nothing is imported."""
    limit = _limit()
    out: dict[str, list[Candidate]] = {}
    for cand in (*_discover_entry_points(), *_registered.values()):
        if limit is not None and cand.name not in limit:
            continue
        out.setdefault(cand.name, []).append(cand)
    return dict(sorted(out.items()))


def register_backend(name: str, cls: type, *, replace: bool = False) -> None:
    """Register a backend class in this process under ``name`` (tests, notebooks, wrappers).

    The name rules are those of entry points. A name already installed or registered is refused
    unless ``replace=True`` (which replaces an earlier in-process registration only).
    """
    _check_name(name)
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a backend class, got {type(cls).__name__}")
    cls_name = getattr(cls, "name", None)
    if cls_name != name:
        raise ValueError(
            f"name {name!r} must equal the class attribute {cls.__qualname__}.name ({cls_name!r})"
        )
    installed = [c for c in _discover_entry_points() if c.name == name]
    if installed:
        raise BackendConflictError(
            f"cannot register backend {name!r} in-process: it is installed by "
            + ", ".join(c.origin for c in installed)
        )
    if name in _registered and not replace:
        raise BackendConflictError(
            f"backend {name!r} is already registered in-process ({_registered[name].value}); "
            "pass replace=True to replace it"
        )
    value = f"{cls.__module__}:{cls.__qualname__}"
    _registered[name] = Candidate(name, value, cls=cls)


def unregister_backend(name: str) -> None:
    """Remove an in-process registration; installed entry points cannot be removed."""
    if name not in _registered:
        raise UnknownBackendError(f"backend {name!r} is not registered in-process")
    del _registered[name]
    _load_class.cache_clear()


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(name).__name__} {name!r}"
        )
    if not NAME_PATTERN.match(name):
        raise ValueError(f"backend name {name!r} is not valid: expected lowercase [a-z0-9_-]+")


def unknown_name_message(name: str, available: Iterable[str]) -> str:
    names = sorted(available)
    msg = f"unknown fusedhead backend {name!r}. "
    msg += f"Installed: {', '.join(names)}." if names else "No backends are installed."
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if close:
        msg += f" Did you mean {close[0]!r}?"
    else:
        close = difflib.get_close_matches(name, list(FIRST_PARTY_EXTRAS), n=1, cutoff=0.6)
        if close and close[0] != name:
            msg += f" Did you mean {close[0]!r} (not installed: pip install '{FIRST_PARTY_EXTRAS[close[0]]}')?"
    if name in FIRST_PARTY_EXTRAS:
        msg += f" Backend {name!r} is provided by: pip install '{FIRST_PARTY_EXTRAS[name]}'."
    else:
        extras = ", ".join(f"{n} ({e})" for n, e in FIRST_PARTY_EXTRAS.items())
        msg += f" First-party backends: {extras}; third-party ones register the entry-point group {ENTRY_POINT_GROUP!r}."
    limit = _limit()
    if limit is not None:
        msg += f" Discovery is limited by {LIMIT_ENV}={os.environ[LIMIT_ENV]!r}."
    return msg


def find(name: str) -> Candidate:
    """The one candidate for exactly ``name``; unknown and conflicting names raise."""
    _check_name(name)
    table = candidates()
    claims = table.get(name)
    if not claims:
        raise UnknownBackendError(unknown_name_message(name, table))
    if len(claims) > 1:
        raise BackendConflictError(
            f"backend {name!r} is claimed by {len(claims)} distributions: "
            + "; ".join(c.origin for c in claims)
            + ". Uninstall one of them; fusedhead never picks one for you."
        )
    return claims[0]


def load_class(name: str) -> type[Any]:
    """Import and check the backend class selected by exactly ``name``."""
    return _load_class(find(name))


@functools.cache
def _load_class(cand: Candidate) -> type[Any]:
    if cand.cls is not None:
        cls = cand.cls
    else:
        assert cand.entry_point is not None
        try:
            cls = cand.entry_point.load()
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            dist = f"{cand.distribution} {cand.version}"
            raise MissingDependencyError(
                f"backend {cand.name!r} ({dist}) could not be imported: {type(exc).__name__}: {exc}. "
                + (
                    f"Install the missing package {missing!r}"
                    if missing
                    else "Install its missing dependency"
                )
                + (
                    f" or reinstall with pip install '{FIRST_PARTY_EXTRAS[cand.name]}'."
                    if cand.name in FIRST_PARTY_EXTRAS
                    else "."
                )
            ) from exc
        except Exception as exc:
            raise BackendLoadError(
                f"backend {cand.name!r} ({cand.distribution} {cand.version}, entry point {cand.value}) "
                f"failed to import: {type(exc).__name__}: {exc}"
            ) from exc
    _check_class(cand, cls)
    return cls


def _check_class(cand: Candidate, cls: Any) -> None:
    from pydantic import BaseModel

    from fusedhead.protocol import SUPPORTED_PLUGIN_API

    where = f"backend {cand.name!r} ({cand.origin})"
    if not isinstance(cls, type):
        raise BackendLoadError(f"{where} must be a class, got {type(cls).__name__}")
    if getattr(cls, "name", None) != cand.name:
        raise BackendLoadError(
            f"{where}: class attribute name is {getattr(cls, 'name', None)!r}, expected {cand.name!r} "
            "(the entry-point name is the backend name)"
        )
    version = getattr(cls, "plugin_api_version", None)
    lo, hi = SUPPORTED_PLUGIN_API
    if not isinstance(version, int) or not lo <= version <= hi:
        raise IncompatibleBackendError(
            f"{where} speaks plugin API version {version!r}; this fusedhead supports {lo}..{hi}. "
            "Upgrade fusedhead or the backend so that their versions match."
        )
    options = getattr(cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise BackendLoadError(f"{where}: Options must be a pydantic BaseModel subclass")
    if options.model_config.get("extra") != "forbid":
        raise BackendLoadError(
            f"{where}: Options must forbid extra fields (model_config extra='forbid')"
        )
    for method in ("capabilities", "check", "forward"):
        if not callable(getattr(cls, method, None)):
            raise BackendLoadError(f"{where}: missing method {method}()")


def listing(*, probe: bool = False, device: Any = None) -> list[BackendListing]:
    """Rows for ``fusedhead list``; with ``probe`` each backend is imported and checked on ``device``."""
    rows: list[BackendListing] = []
    for name, claims in candidates().items():
        first = claims[0]
        if len(claims) > 1:
            why = "claimed by " + "; ".join(c.origin for c in claims)
            for c in claims:
                rows.append(
                    BackendListing(name, c.distribution, c.version, c.value, Status.CONFLICT, why)
                )
            continue
        status, reason = (Status.INSTALLED, None) if not probe else _probe(first, device)
        rows.append(
            BackendListing(name, first.distribution, first.version, first.value, status, reason)
        )
    return rows


def _probe(cand: Candidate, device: Any) -> tuple[Status, str | None]:
    from fusedhead.errors import BackendUnavailableError

    try:
        cls = _load_class(cand)
    except IncompatibleBackendError as exc:
        return Status.INCOMPATIBLE, str(exc)
    except Exception as exc:  # a broken plugin never breaks the listing
        return Status.BROKEN, str(exc)
    try:
        import torch

        dev = torch.device(device) if device is not None else default_device()
        backend = cls(cls.Options())
        caps = backend.capabilities(dev)
        dtype = torch.float32 if "fp32" in caps.dtypes else _dtype_of(caps.dtypes[0])
        backend.check(dev, dtype)
    except BackendUnavailableError as exc:
        return Status.UNAVAILABLE, str(exc)
    except Exception as exc:
        return Status.BROKEN, f"probe failed: {type(exc).__name__}: {exc}"
    return Status.OK, None


def _dtype_of(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def default_device() -> Any:
    """The device a probe or a config without one uses: CUDA if present, else the CPU."""
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
