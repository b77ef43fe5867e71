"""A config's identity: equal settings hash equal and share one resolved head (the provenance hook
fires once for them); a head keeps the settings it runs, whatever happens to the caller's config
afterwards; a value changed in place is validated again, whatever Python's ``==`` says."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

import fusedhead
from fusedhead import FusedHead, FusedHeadConfig, hooks
from fusedhead.api import cached_head, get_fused_head
from fusedhead.errors import OptionsError
from fusedhead.hooks import hookimpl


def test_a_config_is_a_dict_key_and_a_cache_key() -> None:
    """Before: ``TypeError: unhashable type: 'dict'`` from pydantic's frozen hash."""
    a = FusedHeadConfig(options={"chunk_rows": 2}, require=["deterministic"])
    b = FusedHeadConfig(options={"chunk_rows": 2}, require=["deterministic"])
    assert a == b and hash(a) == hash(b)
    assert {a: "head"}[b] == "head"
    assert hash(a) != hash(FusedHeadConfig(options={"chunk_rows": 3}))

    @functools.lru_cache
    def backend_of(config: FusedHeadConfig) -> str:
        return config.backend

    assert backend_of(a) == "torch"


def test_a_head_keeps_its_settings_when_the_callers_config_changes() -> None:
    """Before: ``head.config`` was the caller's object, so an in-place change (even an invalid
    one) showed as the head's settings while the head ran the ones it was built with."""
    config = FusedHeadConfig(options={"chunk_rows": 2})
    head = FusedHead(config)
    config.options["chunk_rows"] = 0
    assert head.config.options == {"chunk_rows": 2} and head.options.chunk_rows == 2


@pytest.mark.parametrize("value", [True, 1.0])
def test_an_option_changed_in_place_to_an_equal_value_of_another_type_is_refused(
    value: Any,
) -> None:
    """``True == 1 == 1.0`` in Python; the options are compared as JSON, so it is validated again
    (before: accepted here, refused when the same config was read back from its dict)."""
    config = FusedHeadConfig(options={"chunk_rows": 1})
    config.options["chunk_rows"] = value
    with pytest.raises(OptionsError, match="option 'chunk_rows'"):
        FusedHead(config)


@pytest.fixture
def resolutions() -> Iterator[list[Any]]:
    """The options each provenance hook call reports, with no head resolved yet."""
    seen: list[Any] = []

    class Recorder:
        @hookimpl
        def fusedhead_backend_resolved(self, name, distribution, version, options, capabilities):  # type: ignore[no-untyped-def]
            seen.append(options.get("chunk_rows"))

    recorder = Recorder()
    fusedhead.refresh()
    hooks.register_hooks(recorder)
    try:
        yield seen
    finally:
        hooks.unregister_hooks(recorder)
        fusedhead.refresh()


def test_equivalent_options_share_one_head_resolved_once(resolutions: list[Any]) -> None:
    """Before: four heads and four hook calls for one validated option set."""
    np = pytest.importorskip("numpy")
    from fusedhead_torch.options import TorchOptions

    spellings = [
        {"chunk_rows": 7},
        TorchOptions(chunk_rows=7),
        {"chunk_rows": 7, "fp32_logits": None},  # a default spelled out
        {"chunk_rows": np.int64(7)},
    ]
    heads = [get_fused_head("torch", options) for options in spellings]
    heads.append(cached_head({"backend": "torch", "options": {"chunk_rows": 7}}))
    assert len({id(head) for head in heads}) == 1
    assert resolutions == [7]


def test_model_validate_names_the_config_once() -> None:
    with pytest.raises(ValueError) as err:
        FusedHeadConfig.model_validate({"temperature": -1.0})
    assert str(err.value).startswith("FusedHeadConfig: field 'temperature' = -1.0 (float)")


def test_a_config_changed_in_place_gets_its_own_head_and_no_one_else_does() -> None:
    """The head cache keys on the options as they are at the call, not as first validated
    (before: the 128-row head was filed under 64 rows, and a caller asking for 64 got it)."""
    fusedhead.refresh()
    try:
        config = FusedHeadConfig.from_dict({"backend": "torch", "options": {"chunk_rows": 64}})
        config.options["chunk_rows"] = 128
        assert cached_head(config).options.chunk_rows == 128
        assert get_fused_head("torch", {"chunk_rows": 64}).options.chunk_rows == 64
    finally:
        fusedhead.refresh()


@pytest.mark.parametrize("same_qualname", [True, False])
def test_a_replaced_registration_is_what_runs_next(same_qualname: bool) -> None:
    """``register_backend(..., replace=True)`` forgets what was resolved to the class it replaces
    (before: the old class kept running, through the loaded-class cache, a class redefined under
    the same qualname, and through the cached heads)."""
    from fusedhead.registry import register_backend, unregister_backend
    from fusedhead_torch.backend import TorchBackend

    first = type("Mine", (TorchBackend,), {"name": "replace-test", "__qualname__": "Mine"})
    again = "Mine" if same_qualname else "MineAgain"
    second = type(again, (TorchBackend,), {"name": "replace-test", "__qualname__": again})
    register_backend("replace-test", first)
    try:
        assert type(get_fused_head("replace-test").backend) is first
        register_backend("replace-test", second, replace=True)
        assert type(get_fused_head("replace-test").backend) is second
        assert type(FusedHead(backend="replace-test").backend) is second
    finally:
        unregister_backend("replace-test")
