"""pluggy hooks: extension points other than "provide a backend by name".

Backends are never provided through hooks (that is the registry's job), and no hook is called to
list backends, so listing never imports anything. Hook implementations come from the entry-point
group ``fusedhead.hooks`` (loaded on the first resolution, not on import or listing) or from
:func:`register_hooks` in-process.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import threading
import warnings
from collections.abc import Iterator
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
        capabilities: dict[str, Any],
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


_manager: pluggy.PluginManager | None = None
#: Held while the manager is made or its entry-point plugins reloaded: one manager a process,
#: each installed plugin imported once, however many threads resolve their first head at once.
_lock = threading.RLock()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with installed hook plugins loaded."""
    global _manager
    pm = _manager
    if pm is not None:
        return pm
    with _lock:
        if _manager is None:
            made = pluggy.PluginManager(PROJECT)
            made.add_hookspecs(HookSpecs)
            _load_entry_points(made)
            _manager = made
        return _manager


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Load each installed hook plugin on its own: one that fails (its import, a ``sys.exit()``
    in it included, or its shape) is skipped with a warning, so a broken observer never breaks
    the selection of a backend."""
    origins: dict[str, str] = {}
    for where, ep in installed_hook_plugins():
        if pm.has_plugin(ep.name) or ep.name in skipped:
            first = origins.get(ep.name)
            if first is not None and first != where:  # another plugin's claim on the name
                skipped[f"{ep.name} ({where})"] = f"{where}: the name is {first}'s"
                warnings.warn(
                    f"fusedhead hook plugin {ep.name!r} from {where} is skipped: {first} "
                    "registered a hook plugin of that name first",
                    HookPluginWarning,
                    stacklevel=2,
                )
            continue
        origins[ep.name] = where
        try:
            plugin = ep.load()
            _check_shape(plugin)
            pm.register(plugin, name=ep.name)
            _check_hook_names(pm, ep.name)
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() is its bug too
            if pm.has_plugin(ep.name):
                pm.unregister(name=ep.name)
            skipped[ep.name] = f"{where}: {type(exc).__name__}: {exc}"
            warnings.warn(
                f"fusedhead hook plugin {ep.name!r} from {where} failed to load and is "
                f"skipped: {type(exc).__name__}: {exc}",
                HookPluginWarning,
                stacklevel=2,
            )
            continue
        _from_entry_points.append(ep.name)


def installed_hook_plugins() -> Iterator[tuple[str, md.EntryPoint]]:
    """Each installed ``fusedhead.hooks`` entry point, with where it comes from (for messages)."""
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group == HOOKS_ENTRY_POINT_GROUP:
                yield f"{dist.metadata['Name']} {dist.version} ({ep.value})", ep


def _check_shape(plugin: object, where: str = "the entry point names") -> None:
    """A hook plugin is a module or an instance: a class's hook methods would be called without
    their instance (every resolution would then fail with a missing argument)."""
    if inspect.isclass(plugin):
        fix = (
            f"point it at a module or an instance (module:plugin, plugin = {plugin.__qualname__}())"
            if where.startswith("the entry point")
            else f"pass an instance: {plugin.__qualname__}()"
        )
        raise TypeError(f"{where} the class {plugin.__qualname__}, not an instance of it: {fix}")


def _check_hook_names(pm: pluggy.PluginManager, name: str) -> None:
    """Every ``@hookimpl`` of the plugin implements a hook fusedhead specifies (a misspelt one
    would never be called, silently)."""
    known = {spec for spec in dir(HookSpecs) if spec.startswith("fusedhead_")}
    for caller in pm.get_hookcallers(pm.get_plugin(name)) or []:
        if caller.name not in known:
            raise ValueError(
                f"its @hookimpl {caller.name!r} is no fusedhead hook (known: {sorted(known)})"
            )


def reload_entry_points() -> None:
    """Drop the hook plugins loaded from entry points and load the installed ones again
    (plugins registered in-process stay)."""
    if _manager is None:
        return
    with _lock:
        _reload(_manager)


def _reload(pm: pluggy.PluginManager) -> None:
    for name in _from_entry_points:
        plugin = pm.get_plugin(name)
        if plugin is not None:
            pm.unregister(name=name)
    _from_entry_points.clear()
    skipped.clear()
    _load_entry_points(pm)


def register_hooks(plugin: object, name: str | None = None) -> None:
    """Register an object (module or instance) whose ``@hookimpl`` methods implement hooks;
    a class, or a hook fusedhead does not specify, is refused as an entry point's would be."""
    _check_shape(plugin, "register_hooks got")
    pm = plugin_manager()
    registered = pm.register(plugin, name=name)
    try:
        _check_hook_names(pm, registered or "")
    except ValueError:
        pm.unregister(plugin)
        raise


def unregister_hooks(plugin: object) -> None:
    """Remove a plugin registered with :func:`register_hooks`."""
    plugin_manager().unregister(plugin)
