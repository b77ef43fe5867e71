"""The backend registry: entry-point discovery by metadata, selection by exact name, lazy import.

Discovery reads distribution metadata only (no backend module is imported) and is cached per
process. A backend is imported when, and only when, its exact configured name is selected. There is
no priority, no autodetection and no fallback: an unknown name is an error that lists what is there.

What such an error says is :mod:`fusedhead.registry_messages`'s; a loaded class is checked against
the plugin API by :mod:`fusedhead.plugin_shape`; the name rule and the reserved names are
:mod:`fusedhead.backend_names`'s. Those of their names that callers reach through this module
(``NAME_PATTERN``, ``verify_backend_class``, ...) are re-exported here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fusedhead import install_hints, registry_messages
from fusedhead import options as _options
from fusedhead.backend_names import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from fusedhead.backend_names import LIMIT_ENV as LIMIT_ENV
from fusedhead.backend_names import NAME_PATTERN as NAME_PATTERN
from fusedhead.backend_names import RESERVED_NAMES as RESERVED_NAMES
from fusedhead.entry_point_load import load_entry_point
from fusedhead.errors import (
    BackendConflictError,
    BackendContractError,
    BackendError,
    BackendLoadError,
    UnknownBackendError,
    exception_text,
)
from fusedhead.options import validate_options
from fusedhead.plugin_shape import PUBLISHED_PLUGIN_API as PUBLISHED_PLUGIN_API
from fusedhead.plugin_shape import verify_backend_class as verify_backend_class


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


_registered: dict[str, Candidate] = {}


def _limit() -> set[str] | None:
    """The names ``FUSEDHEAD_BACKENDS`` limits discovery to; None (no limit) where it names none
    (unset, blank, or only commas: ',' must not hide every backend while '' hides none)."""
    raw = os.environ.get(LIMIT_ENV) or ""
    names = {part.strip() for part in raw.split(",") if part.strip()}
    return names or None


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
            key = (install_hints.normalize(dist_name), ep.name)
            if key in seen:  # the same distribution seen twice on sys.path
                continue
            seen.add(key)
            found.append(Candidate(ep.name, ep.value, dist_name, dist.version, entry_point=ep))
    return tuple(
        sorted(found, key=lambda c: (c.name, install_hints.normalize(c.distribution or "")))
    )


_refresh_callbacks: list[Callable[[], None]] = []


def on_refresh(callback: Callable[[], None]) -> None:
    """Have :func:`refresh` call ``callback`` (a module's cache of resolved heads, say)."""
    _refresh_callbacks.append(callback)


def refresh() -> None:
    """Forget every cache: discovery, loaded classes, resolved heads, hook plugins.

    Call it after installing or removing a distribution in this process, or after changing
    ``FUSEDHEAD_BACKENDS``. ``importlib.invalidate_caches`` also clears importlib.metadata's
    directory listings.
    """
    _discover_entry_points.cache_clear()
    load_candidate.cache_clear()
    importlib.invalidate_caches()
    for callback in _refresh_callbacks:
        callback()
    from fusedhead.hooks import reload_entry_points

    reload_entry_points()


def installed_entry_points() -> tuple[Candidate, ...]:
    """Every installed claim (one per distribution and name), ignoring ``FUSEDHEAD_BACKENDS``.

    What is installed, not what discovery shows; metadata only, sorted by name. In-process
    registrations are not included (they are not installed).
    """
    return _discover_entry_points()


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
    unless ``replace=True`` (which replaces an earlier in-process registration only). The class's
    shape is checked as the entry-point loader checks it (:func:`verify_backend_class`): a class
    that breaks the plugin API raises ``BackendLoadError``/``IncompatibleBackendError`` here.
    """
    _check_name(name)
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a backend class, got {type(cls).__name__}")
    cls_name = getattr(cls, "name", None)
    if cls_name != name:
        raise ValueError(
            f"name {name!r} must equal the class attribute {cls.__qualname__}.name ({cls_name!r})"
        )
    if name in RESERVED_NAMES:
        raise BackendConflictError(
            f"cannot register {cls.__qualname__} in-process as {name!r}: the name is reserved for "
            f"the first-party distribution {RESERVED_NAMES[name]}",
            backend=name,
            claimants=(f"registered in-process ({cls.__module__}:{cls.__qualname__})",),
            hint="register it under another name",
        )
    installed = [c for c in _discover_entry_points() if c.name == name]
    if installed:
        raise BackendConflictError(
            "cannot be registered in-process: it is installed by "
            + ", ".join(c.origin for c in installed),
            backend=name,
            claimants=tuple(c.origin for c in installed),
            hint="register it under another name, or uninstall the distribution",
        )
    if name in _registered and not replace:
        raise BackendConflictError(
            f"is already registered in-process ({_registered[name].value})",
            backend=name,
            claimants=(_registered[name].origin,),
            hint="pass replace=True to replace it",
        )
    # The shape the entry-point loader checks, here: a bad class fails where it is registered,
    # not at its first call.
    verify_backend_class(cls, backend=name, distribution=None, version=None)
    value = f"{cls.__module__}:{cls.__qualname__}"
    replaced = name in _registered
    _registered[name] = Candidate(name, value, cls=cls)
    if replaced:  # nothing resolved to the class it replaces may run again
        _forget_registration()


def _forget_registration() -> None:
    """The caches that may hold an in-process class: loaded classes and resolved heads."""
    load_candidate.cache_clear()
    for callback in _refresh_callbacks:
        callback()


def unregister_backend(name: str) -> None:
    """Remove an in-process registration; installed entry points cannot be removed."""
    if name.__class__ is not str:
        _check_name(name)  # a TypeError naming what it got
    if name not in _registered:
        names = sorted(_registered)
        raise UnknownBackendError(
            f"backend {name!r} is not registered in-process (registered in-process: "
            f"{', '.join(names) if names else 'none'})",
            backend=name,
            hint="installed entry points are removed by uninstalling their distribution",
        )
    del _registered[name]
    _forget_registration()  # heads resolved to the removed class go too


def _check_name(name: object, known: Iterable[str] | None = None) -> None:
    """``name`` is a str that follows the entry points' naming rule, else a ``TypeError`` or a
    ``ValueError`` (:func:`registry_messages.check_name`). ``known``: the names a lookup could
    find, so that a misspelt one is pointed at one of them, not at its own lowercase."""
    registry_messages.check_name(name, known, lambda: _hidden_by_limit(_limit()))


def _hidden_by_limit(limit: set[str] | None) -> dict[str, str]:
    """Names that exist here but ``FUSEDHEAD_BACKENDS`` (``limit``) leaves out, each with how it
    exists (``installed`` or ``registered in-process``): a name the user asks for among these
    needs the variable changed, never a pip install."""
    if limit is None:
        return {}
    found = {c.name: "installed" for c in installed_entry_points() if c.name not in limit}
    for reg in _registered.values():
        if reg.name not in limit:
            found.setdefault(reg.name, "registered in-process")
    return found


def unknown_name_message(name: str, available: Iterable[str]) -> str:
    """Why ``name`` selects nothing among ``available``, told from what is installed, registered
    and hidden by ``FUSEDHEAD_BACKENDS`` now (:func:`registry_messages.unknown_name_message`)."""
    limit = _limit()
    hidden = _hidden_by_limit(limit)
    return registry_messages.unknown_name_message(name, available, limit, hidden, candidates)


def reserved_violation(cand: Candidate) -> str | None:
    """Why ``cand`` may not claim its name (a reserved name from another distribution), or None."""
    owner = RESERVED_NAMES.get(cand.name)
    if owner is None or install_hints.normalize(cand.distribution or "") == owner:
        return None
    return (
        f"the name {cand.name!r} is reserved for the first-party distribution {owner}, "
        f"and {cand.origin} claims it"
    )


def name_violation(cand: Candidate) -> str | None:
    """Why ``cand``'s entry-point name cannot be selected (it breaks the name rule), or None."""
    if NAME_PATTERN.match(cand.name):
        return None
    return (
        f"entry-point name {cand.name!r} of {cand.origin} breaks the name rule "
        "(lowercase [a-z0-9_-]+); its distribution must rename it"
    )


def claims_allowed(claims: list[Candidate]) -> list[Candidate]:
    """The claims (of one name) that may hold it: a reserved name's owner wins over third parties."""
    return [c for c in claims if reserved_violation(c) is None]


def find(name: str) -> Candidate:
    """The one candidate for exactly ``name``; unknown, reserved and conflicting names raise."""
    table = candidates()
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        for cand in table.get(name, []) if isinstance(name, str) else []:
            # exactly an installed entry point's name: that distribution is what to fix
            raise BackendLoadError(
                f"cannot be selected: {name_violation(cand)}",
                backend=name,
                distribution=cand.distribution,
                version=cand.version,
                hint=f"ask the authors of {cand.distribution or 'that distribution'} to name "
                "it by the rule; no spelling of it can be selected until then",
            )
        _check_name(name, known=table)
    claims = table.get(name)
    if not claims:
        raise UnknownBackendError(unknown_name_message(name, table), backend=name)
    allowed = claims_allowed(claims)
    if not allowed:
        bad = claims[0]
        raise BackendConflictError(
            reserved_violation(bad) or "reserved",
            backend=name,
            distribution=bad.distribution,
            version=bad.version,
            claimants=tuple(c.origin for c in claims),
            hint=f"install the first-party backend ({install_hints.install_command(name)}) "
            f"and uninstall {bad.distribution}",
        )
    if len(allowed) > 1:
        raise BackendConflictError(
            f"is claimed by {len(allowed)} distributions: " + "; ".join(c.origin for c in allowed),
            backend=name,
            claimants=tuple(c.origin for c in allowed),
            hint="uninstall all but one of them; fusedhead never picks one for you",
        )
    return allowed[0]


def load_class(name: str) -> type[Any]:
    """Import and check the backend class selected by exactly ``name``."""
    return load_candidate(find(name))


class Resolved(NamedTuple):
    """A backend name resolved: its registry entry, its checked class, its validated options."""

    entry: Candidate
    cls: type[Any]
    options: Any  #: an instance of ``cls.Options``


def resolve(name: str, options: Any = None, earlier: Resolved | None = None) -> Resolved:
    """``name`` resolved once into (entry, class, options): the one candidate for exactly that
    name, its class imported and checked, ``options`` validated strictly against its ``Options``.
    ``earlier`` (a config's own resolution) is returned as it is while ``name`` still selects
    the same entry (no registration, refresh or ``FUSEDHEAD_BACKENDS`` change since) and
    ``options`` are still the ones it validated (a config's options dict changed in place, or by
    ``model_copy(update=...)``, which skips validation, is validated again, not ignored)."""
    entry = find(name)
    if earlier is not None and earlier.entry is entry and _validated(earlier, options):
        return earlier
    cls = load_candidate(entry)
    return Resolved(entry, cls, validate_options(name, cls, options))


def _validated(earlier: Resolved, options: Any) -> bool:
    """Whether ``options`` are what ``earlier`` validated (a config keeps them as its JSON dump),
    compared as JSON text: ``True`` is not ``1``, nor ``1.0``, though Python finds them equal, so
    a value changed in place to another type is validated again."""
    if options is None or options is earlier.options:
        return True
    if not isinstance(options, Mapping):
        return False
    dumped = earlier.options.model_dump(mode="json", exclude_unset=True)
    try:
        return json.dumps(dict(options), sort_keys=True) == json.dumps(dumped, sort_keys=True)
    except (TypeError, ValueError):  # not JSON (a NumPy number): validated again
        return False


def _identity_of(name: str) -> tuple[str | None, str | None]:
    """(distribution, version) of the one claim on ``name``, for an options error; else Nones."""
    claims = candidates().get(name) or []
    if len(claims) != 1:
        return None, None
    return claims[0].distribution, claims[0].version


_options.identity_of = _identity_of


def error_fields(cand: Candidate) -> dict[str, Any]:
    """The identity an error about ``cand`` carries (backend, distribution, version)."""
    return {"backend": cand.name, "distribution": cand.distribution, "version": cand.version}


@functools.cache
def load_candidate(cand: Candidate) -> type[Any]:
    """``cand``'s class, imported and verified once per process (an import failure triaged)."""
    if cand.cls is not None:
        cls = cand.cls
    else:
        assert cand.entry_point is not None
        cls = load_entry_point(cand, cand.entry_point, error_fields(cand))
    verify_backend_class(cls, **error_fields(cand))
    return cls


def construct_backend(cls: type[Any], options: Any, /, **fields: Any) -> Any:
    """``cls(options)``, as the core makes a backend: a ``BackendError`` it raises gets ``fields``
    (who it is); any other exception is the plugin's own bug, a ``BackendContractError``."""
    try:
        return cls(options)
    except BackendError as exc:
        raise exc.attach(**fields) from None
    except Exception as exc:
        raise BackendContractError(
            f"__init__(options) raised {exception_text(exc)}",
            hint="a backend's __init__ must take its validated options without failing (what "
            "keeps it from running here goes in check(), as fusedhead.errors."
            "BackendUnavailableError with the reason and the fix); report this to the "
            "backend's authors",
            **fields,
        ) from exc


def backend_capabilities(instance: Any, device: Any, /, **fields: Any) -> Any:
    """``instance.capabilities(device)`` (a backend object), checked to be a ``Capabilities``: a ``BackendError`` it
    raises gets ``fields``; any other exception, or another return value, is a
    ``BackendContractError`` naming the backend and what was expected."""
    from fusedhead.protocol import Capabilities

    hint = (
        "capabilities(device) must return a fusedhead.protocol.Capabilities built from valid "
        "values (docs/writing-a-backend.md lists its fields); report this to the backend's authors"
    )
    try:
        caps = instance.capabilities(device)
    except BackendError as exc:
        raise exc.attach(**fields) from None
    except Exception as exc:
        raise BackendContractError(
            f"capabilities({device}) raised {exception_text(exc)}", hint=hint, **fields
        ) from exc
    if not isinstance(caps, Capabilities):
        got = f"{type(caps).__name__} {caps!r}"
        raise BackendContractError(
            f"capabilities({device}) must return fusedhead.protocol.Capabilities, got "
            + (got if len(got) <= 120 else got[:117] + "..."),
            hint=hint,
            **fields,
        )
    # What it declares must have its method: else it fails only when first called.
    for declared, method in ((caps.policy_loss, "policy_loss"), (caps.kl_directions, "kl")):
        if declared and not callable(getattr(instance, method, None)):
            raise BackendContractError(
                f"capabilities({device}) declares {method} but the backend has no "
                f"{method}(call) method",
                hint="add the method (docs/writing-a-backend.md) or drop the declaration; report "
                "this to the backend's authors",
                **fields,
            )
    return caps


def default_device() -> Any:
    """The device a probe or a config without one uses: CUDA if present, else the CPU."""
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
