"""pluggy hooks: extension points other than "provide a backend by name".

Backends are never provided through hooks (that is the registry's job), and no hook is called to
list backends, so listing never imports anything. Hook implementations come from the entry-point
group ``fusedhead.hooks`` (loaded on the first resolution, not on import or listing) or from
:func:`register_hooks` in-process.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with installed hook plugins loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    pm.load_setuptools_entrypoints(HOOKS_ENTRY_POINT_GROUP)
    return pm


def register_hooks(plugin: object, name: str | None = None) -> None:
    """Register an object (module or instance) whose ``@hookimpl`` methods implement hooks."""
    plugin_manager().register(plugin, name=name)


def unregister_hooks(plugin: object) -> None:
    """Remove a plugin registered with :func:`register_hooks`."""
    plugin_manager().unregister(plugin)
