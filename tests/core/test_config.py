"""FusedHeadConfig: loads from dict, YAML and OmegaConf, validates the backend's options, round-trips."""

from __future__ import annotations

import pytest

from fusedhead import FusedHead, FusedHeadConfig
from fusedhead.errors import CapabilityError, UnknownBackendError


def test_from_dict_and_round_trip(ref_backend):
    cfg = FusedHeadConfig.from_dict(
        {"backend": "ref-test", "options": {"tag": "y"}, "temperature": 0.7}
    )
    assert cfg.options == {"tag": "y"} and cfg.temperature == 0.7
    assert FusedHeadConfig.from_dict(cfg.to_dict()) == cfg


def test_from_yaml(ref_backend):
    cfg = FusedHeadConfig.from_yaml(
        "backend: ref-test\noptions:\n  tag: z\nrequire: [deterministic]\n"
    )
    assert (
        cfg.backend == "ref-test"
        and cfg.options == {"tag": "z"}
        and cfg.require == ["deterministic"]
    )


def test_from_omegaconf(ref_backend):
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(
        {"t": 0.5, "head": {"backend": "ref-test", "temperature": "${t}"}}
    )
    cfg = FusedHeadConfig.from_omegaconf(node.head)
    assert cfg.temperature == 0.5


def test_backend_options_are_validated_against_its_model(ref_backend):
    with pytest.raises(ValueError) as info:
        FusedHeadConfig(backend="ref-test", options={"tga": "y"})
    assert "ref-test" in str(info.value) and "tga" in str(info.value)


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="backnd"):
        FusedHeadConfig.from_dict({"backnd": "torch"})


def test_unknown_backend_fails_at_config_time(ref_backend):
    with pytest.raises(UnknownBackendError, match="Did you mean 'ref-test'"):
        FusedHeadConfig(backend="ref-tset")


def test_unknown_capability_is_rejected(ref_backend):
    with pytest.raises(ValueError, match="batch_invariance"):
        FusedHeadConfig(backend="ref-test", require=["batch_invariance"])


def test_required_capability_is_checked_at_resolution_and_never_picks(ref_backend):
    with pytest.raises(CapabilityError, match="batch_invariant"):
        FusedHead(FusedHeadConfig(backend="ref-test", require=["batch_invariant"], device="cpu"))
    ref_backend.caps = {"batch_invariant": True}
    head = FusedHead({"backend": "ref-test", "require": ["batch_invariant"], "device": "cpu"})
    assert head.name == "ref-test"


@pytest.mark.parametrize(
    "field,value", [("temperature", 0.0), ("temperature", float("nan")), ("softcap", -1.0)]
)
def test_call_defaults_are_validated(ref_backend, field, value):
    with pytest.raises(ValueError, match=field):
        FusedHeadConfig(backend="ref-test", **{field: value})
