"""A loaded backend class checked against plugin API v2, as pluggy checks hook implementations.

Its attributes (``name``, ``plugin_api_version``, ``Options``) and each method's parameters; each
breach a ``BackendLoadError`` or ``IncompatibleBackendError`` naming the plugin's distribution
(the identity the registry passes in), with the fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from fusedhead.errors import BackendLoadError, IncompatibleBackendError

#: Plugin API versions a published fusedhead speaks, each with the releases that speak it. Version
#: 1 (the 13-argument ``forward`` of the 0.x series) is not here: no fusedhead speaking it was
#: published (docs/writing-a-backend.md), so no advice may send a backend's users to one; nor to a
#: fusedhead for a version newer than this one speaks, unless it is here (a release may not exist).
PUBLISHED_PLUGIN_API = {2: "fusedhead 1.x"}


def verify_backend_class(cls: Any, **fields: Any) -> None:
    """Check a backend class's shape against the plugin API, as pluggy checks hook implementations.

    Attributes (``name``, ``plugin_api_version``, ``Options``), and each method's parameters
    (``__init__(options)``, ``capabilities(device)``, ``check(device, dtype)``, ``forward(call)``,
    and ``policy_loss(call)`` / ``kl(call)`` where the class defines them). Raises
    ``BackendLoadError``/``IncompatibleBackendError`` carrying ``fields``.
    """
    from pydantic import BaseModel

    from fusedhead.protocol import (
        METHOD_PARAMETERS,
        OPTIONAL_METHOD_PARAMETERS,
        SUPPORTED_PLUGIN_API,
    )

    name = fields.get("backend")

    def broken(reason: str, hint: str) -> BackendLoadError:
        return BackendLoadError(reason, hint=hint, **fields)

    if not isinstance(cls, type):
        if inspect.ismodule(cls):
            got = f"the module {cls.__name__!r}"
        elif inspect.isroutine(cls):
            got = f"the function {getattr(cls, '__qualname__', cls)!r}"
        else:
            got = f"an instance of {type(cls).__name__}"
        fix = "point the entry point at the backend class (module:Class)" + (
            ", not an instance of it" if got.startswith("an instance") else ""
        )
        raise broken(f"the entry point must name a class, got {got}", fix)
    if getattr(cls, "name", None) != name:
        raise broken(
            f"class attribute {cls.__qualname__}.name is {getattr(cls, 'name', None)!r}, expected "
            f"{name!r} (the entry-point name is the backend name)",
            "make the two names equal",
        )
    lo, hi = SUPPORTED_PLUGIN_API
    if not hasattr(cls, "plugin_api_version"):
        raise broken(
            f"{cls.__qualname__} does not define plugin_api_version (a class attribute: the "
            f"plugin API version it speaks, {hi})",
            f"add plugin_api_version = {hi} to the class (docs/writing-a-backend.md)",
        )
    version = cls.plugin_api_version
    if isinstance(version, bool) or not isinstance(version, int):  # True is an int subclass
        raise broken(
            f"{cls.__qualname__}.plugin_api_version must be an int, got "
            f"{type(version).__name__} {version!r}",
            f"set plugin_api_version = {hi} (an int, not a str or a float)",
        )
    if not lo <= version <= hi:
        speaks = f"version {lo}" if lo == hi else f"versions {lo} to {hi}"
        raise IncompatibleBackendError(
            f"speaks plugin API version {version!r}; this fusedhead speaks {speaks}",
            hint=_version_hint(version, hi),
            **fields,
        )
    if not hasattr(cls, "Options"):
        raise broken(
            f"{cls.__qualname__} does not define Options (a class attribute: the pydantic "
            "BaseModel subclass of its options)",
            "declare Options = fusedhead.protocol.NoOptions for a backend without options",
        )
    options = cls.Options
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise broken(
            f"{cls.__qualname__}.Options must be a pydantic BaseModel subclass, got {options!r}",
            "declare Options = fusedhead.protocol.NoOptions for a backend without options",
        )
    if options.model_config.get("extra") != "forbid":
        raise broken(
            f"{cls.__qualname__}.Options must forbid extra fields",
            "set model_config = ConfigDict(extra='forbid', frozen=True)",
        )
    for method, params in {"__init__": ("options",), **METHOD_PARAMETERS}.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise broken(
                f"{cls.__qualname__} has no method {method}()",
                f"define {method}(self, {', '.join(params)})",
            )
        if method == "__init__" and fn is object.__init__:
            raise broken(
                f"{cls.__qualname__}.__init__ must take the validated options",
                "define __init__(self, options)",
            )
        if not _accepts(fn, len(params)):
            raise broken(
                f"{cls.__qualname__}.{method}{_signature(fn)} does not take "
                f"({', '.join(params)}) as plugin API {version} calls it",
                f"define {method}(self, {', '.join(params)})",
            )
    for method, params in OPTIONAL_METHOD_PARAMETERS.items():
        fn = getattr(cls, method, None)
        if callable(fn) and not _accepts(fn, len(params)):
            raise broken(
                f"{cls.__qualname__}.{method}{_signature(fn)} does not take "
                f"({', '.join(params)}) as plugin API {version} calls it",
                f"define {method}(self, {', '.join(params)})",
            )


def _version_hint(version: int, hi: int) -> str:
    """What to upgrade or port for a backend speaking plugin API ``version`` where this fusedhead
    speaks up to ``hi``: never a fusedhead that was not published (:data:`PUBLISHED_PLUGIN_API`)."""
    if version > hi and version in PUBLISHED_PLUGIN_API:
        return (
            f"the backend needs a newer fusedhead: upgrade fusedhead to "
            f"{PUBLISHED_PLUGIN_API[version]}, which speaks plugin API {version}, or use a "
            f"release of the backend for API {hi}"
        )
    if version > hi:  # a fusedhead speaking it may be out after this one, or may never be
        return (
            f"the backend needs a newer fusedhead: upgrade fusedhead to one that speaks "
            f"plugin API {version} if such a release exists (this fusedhead knows of none), "
            f"else use a release of the backend for plugin API {hi}"
        )
    if version in PUBLISHED_PLUGIN_API:
        return (
            f"the backend is older than this fusedhead: upgrade its distribution to one for "
            f"plugin API {hi} (docs/writing-a-backend.md), or use "
            f"{PUBLISHED_PLUGIN_API[version]}, which speaks {version}"
        )
    # no published fusedhead ever spoke it: no downgrade of fusedhead helps
    return (
        f"the backend is older than this fusedhead: upgrade its distribution to one for "
        f"plugin API {hi}, or port it to plugin API {hi} (docs/writing-a-backend.md); "
        f"no published fusedhead speaks plugin API {version}, so no other fusedhead helps"
    )


def _signature(fn: Any) -> str:
    """``fn``'s signature as text, ``(...)`` where it has none to read."""
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _accepts(fn: Any, n_positional: int) -> bool:
    """Whether ``fn(self, *n_positional args)`` binds (unknown signatures pass)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        sig.bind(object(), *([None] * n_positional))
    except TypeError:
        return False
    return True
