"""Installed ``fusedhead.hooks`` plugins load once per process, and one that is broken in any way
(its import, a ``sys.exit()`` at import, a class named where an instance belongs, a hook name
fusedhead does not specify) is skipped with a ``HookPluginWarning``: it never breaks a call."""

from __future__ import annotations

import importlib.metadata as md
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedhead import fused_head, hooks
from fusedhead.hooks import HookPluginWarning

MODULES = {
    "fh_hooks_good": (
        "from fusedhead.hooks import hookimpl\n"
        "calls = []\n"
        "@hookimpl\n"
        "def fusedhead_backend_resolved(name, distribution, version, options, capabilities):\n"
        "    calls.append(name)\n"
    ),
    "fh_hooks_exits": "import sys\nsys.exit(3)\n",
    "fh_hooks_class": (
        "from fusedhead.hooks import hookimpl\n"
        "class Plugin:\n"
        "    @hookimpl\n"
        "    def fusedhead_backend_resolved(self, name, distribution, version, options,\n"
        "                                   capabilities):\n"
        "        pass\n"
    ),
    "fh_hooks_typo": (
        "from fusedhead.hooks import hookimpl\n"
        "@hookimpl\n"
        "def fusedhead_backend_resolve(name, distribution, version, options, capabilities):\n"
        "    pass\n"
    ),
}
ENTRY_POINTS = {
    "good": "fh_hooks_good",
    "exits": "fh_hooks_exits",
    "klass": "fh_hooks_class:Plugin",
    "typo": "fh_hooks_typo",
}


def _installed() -> Iterator[tuple[str, md.EntryPoint]]:
    """The test distribution's hook entry points, as ``hooks.installed_hook_plugins`` lists them."""
    for name, value in ENTRY_POINTS.items():
        yield (
            f"fh-hooks-test 1.0 ({value})",
            md.EntryPoint(name, value, hooks.HOOKS_ENTRY_POINT_GROUP),
        )


@pytest.fixture
def fresh_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No plugin manager yet, and the one test distribution installed."""
    for module, source in MODULES.items():
        (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hooks, "installed_hook_plugins", _installed)
    saved = (hooks._manager, list(hooks._from_entry_points), dict(hooks.skipped))
    hooks._manager = None
    hooks._from_entry_points.clear()
    hooks.skipped.clear()
    try:
        yield
    finally:
        hooks._manager, hooks._from_entry_points[:] = saved[0], saved[1]
        hooks.skipped.clear()
        hooks.skipped.update(saved[2])
        for module in MODULES:
            sys.modules.pop(module, None)


def test_each_broken_plugin_is_skipped_with_its_reason_and_calls_go_on(fresh_manager: Any) -> None:
    with pytest.warns(HookPluginWarning) as caught:
        pm = hooks.plugin_manager()
    reasons = {name: hooks.skipped[name] for name in ("exits", "klass", "typo")}
    assert "SystemExit: 3" in reasons["exits"]  # before: SystemExit out of every call
    assert "names the class Plugin, not an instance of it" in reasons["klass"]  # before: a
    # TypeError (missing argument 'capabilities') out of every resolution, naming no plugin
    assert "'fusedhead_backend_resolve' is no fusedhead hook" in reasons["typo"]  # before: silent
    assert len(caught) == 3
    assert hooks._from_entry_points == ["good"] and pm.has_plugin("good")
    assert not any(pm.has_plugin(name) for name in ("exits", "klass", "typo"))
    good = sys.modules["fh_hooks_good"]
    out = fused_head(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), backend="torch",
                     options={"chunk_rows": 3})  # fmt: skip
    assert out.log_probs.shape == (3,) and good.calls == ["torch"]


def test_threads_resolving_their_first_head_at_once_make_one_manager(fresh_manager: Any) -> None:
    """Before: each thread could build its own manager, import the plugins again and warn again."""
    barrier = threading.Barrier(8)
    managers: list[Any] = []

    def first() -> None:
        barrier.wait()
        managers.append(hooks.plugin_manager())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=first) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len({id(pm) for pm in managers}) == 1
    assert hooks._from_entry_points == ["good"]
    assert sum(issubclass(w.category, HookPluginWarning) for w in caught) == 3


def test_register_hooks_refuses_what_an_entry_point_is_refused_for() -> None:
    """Before: a class was registered and every resolution then failed with a missing argument;
    a misspelt hook was registered and never called."""
    from fusedhead.hooks import hookimpl

    class Observer:
        @hookimpl
        def fusedhead_backend_resolved(self, name, distribution, version, options, capabilities):  # type: ignore[no-untyped-def]
            pass

    class Misspelt:
        @hookimpl
        def fusedhead_backend_resolve(self, name):  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(
        TypeError, match=r"register_hooks got the class .*Observer, not an instance"
    ):
        hooks.register_hooks(Observer)
    misspelt = Misspelt()
    with pytest.raises(ValueError, match="'fusedhead_backend_resolve' is no fusedhead hook"):
        hooks.register_hooks(misspelt)
    assert not hooks.plugin_manager().is_registered(misspelt)
    out = fused_head(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]))
    assert out.log_probs.shape == (3,)


def test_a_second_plugin_of_one_name_is_skipped_with_a_warning(
    fresh_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the second distribution's plugin was dropped without a word."""

    def two_claims() -> Iterator[tuple[str, md.EntryPoint]]:
        for dist in ("fh-hooks-a 1.0", "fh-hooks-b 2.0"):
            group = hooks.HOOKS_ENTRY_POINT_GROUP
            yield f"{dist} (fh_hooks_good)", md.EntryPoint("good", "fh_hooks_good", group)

    monkeypatch.setattr(hooks, "installed_hook_plugins", two_claims)
    with pytest.warns(HookPluginWarning, match=r"'good' from fh-hooks-b 2\.0 .* is skipped: "):
        hooks.plugin_manager()
    assert hooks._from_entry_points == ["good"]
