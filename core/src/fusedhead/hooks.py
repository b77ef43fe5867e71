"""pluggy hooks: extension points other than "provide a backend by name".

Backends are never provided through hooks (that is the registry's job), and no hook is called to
list backends, so listing never imports anything. Hook implementations come from the entry-point
group ``fusedhead.hooks`` (loaded on the first resolution, not on import or listing) or from
:func:`register_hooks` in-process.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import warnings
from typing import Any

import pluggy

PROJECT = "fusedhead"
HOOKS_ENTRY_POINT_GROUP = "fusedhead.hooks"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Decorate a function or method with ``@fusedhead.hooks.hookimpl`` to implement a hook.
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """The hook specifications."""

    @hookspec
    def fusedhead_backend_resolved(
        self,
        name: str,
        distribution: str | None,
        version: str | None,
        options: dict[str, Any],
        capabilities: dict[str, Any] | None,
    ) -> None:
        """Called once each time a backend is resolved (by ``FusedHead`` or a first ``fused_head`` call).

        ``distribution``/``version`` are None for an in-process registration; ``capabilities`` are
        those on the resolution device. Use it to log provenance. Raising an exception vetoes the
        resolution (to enforce a mode, e.g. only batch-invariant backends in evaluation); the
        exception propagates to the caller unchanged. It must not mutate ``options``.
        """


class HookPluginWarning(UserWarning):
    """A ``fusedhead.hooks`` plugin failed to load and was skipped."""


#: Names of the hook plugins loaded from entry points, and why the others were skipped.
_from_entry_points: list[str] = []
skipped: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with installed hook plugins loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    _load_entry_points(pm)
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Load each installed hook plugin on its own: one that fails is skipped with a warning,
    so a broken observer never breaks the selection of a backend."""
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group != HOOKS_ENTRY_POINT_GROUP or pm.has_plugin(ep.name):
                continue
            where = f"{dist.metadata['Name']} {dist.version} ({ep.value})"
            try:
                pm.register(ep.load(), name=ep.name)
            except Exception as exc:
                skipped[ep.name] = f"{where}: {type(exc).__name__}: {exc}"
                warnings.warn(
                    f"fusedhead hook plugin {ep.name!r} from {where} failed to load and is "
                    f"skipped: {type(exc).__name__}: {exc}",
                    HookPluginWarning,
                    stacklevel=2,
                )
                continue
            _from_entry_points.append(ep.name)


def reload_entry_points() -> None:
    """Drop the hook plugins loaded from entry points and load the installed ones again
    (plugins registered in-process stay)."""
    if plugin_manager.cache_info().currsize == 0:
        return
    pm = plugin_manager()
    for name in _from_entry_points:
        plugin = pm.get_plugin(name)
        if plugin is not None:
            pm.unregister(name=name)
    _from_entry_points.clear()
    skipped.clear()
    _load_entry_points(pm)


def register_hooks(plugin: object, name: str | None = None) -> None:
    """Register an object (module or instance) whose ``@hookimpl`` methods implement hooks."""
    plugin_manager().register(plugin, name=name)


def unregister_hooks(plugin: object) -> None:
    """Remove a plugin registered with :func:`register_hooks`."""
    plugin_manager().unregister(plugin)
