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


def test_from_omegaconf_names_a_value_left_missing(ref_backend):
    """Before: '???' was read as text: "backend name '???' is not valid", "expected float"."""
    omegaconf = pytest.importorskip("omegaconf")
    node = omegaconf.OmegaConf.create(
        {"head": {"backend": "???", "temperature": "???", "options": {"x": "???"}}}
    )
    with pytest.raises(
        ValueError,
        match=r"FusedHeadConfig: head.backend, head.options.x, head.temperature: OmegaConf.s missing",
    ):
        FusedHeadConfig.from_omegaconf(node.head)


def test_backend_options_are_validated_against_its_model(ref_backend):
    with pytest.raises(ValueError) as info:
        FusedHeadConfig(backend="ref-test", options={"tga": "y"})
    assert "ref-test" in str(info.value) and "tga" in str(info.value)


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="backnd"):
        FusedHeadConfig.from_dict({"backnd": "torch"})


def test_a_whole_trainer_config_points_at_its_fused_head_section():
    with pytest.raises(ValueError, match="unknown field 'fused_head'") as info:
        FusedHeadConfig.from_dict({"fused_head": {"backend": "torch"}})
    assert "from_dict(config['fused_head'])" in str(info.value)


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


# --- the config's device: one this process cannot use is refused where a head is resolved --------


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _one_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_a_cuda_device_without_cuda_is_refused_at_construction(ref_backend, monkeypatch, device):
    from fusedhead import FusedLMHead
    from fusedhead.api import cached_head

    _no_cuda(monkeypatch)
    import torch

    weight = torch.nn.Parameter(torch.randn(11, 8))
    builds = {
        "FusedHead(device=)": lambda: FusedHead(backend="ref-test", device=device),
        "FusedHead(config)": lambda: FusedHead(FusedHeadConfig(backend="ref-test", device=device)),
        "FusedHead(mapping)": lambda: FusedHead({"backend": "ref-test", "device": device}),
        "FusedLMHead": lambda: FusedLMHead(weight, {"backend": "ref-test", "device": device}),
        "cached_head": lambda: cached_head({"backend": "ref-test", "device": device}),
    }
    for what, build in builds.items():
        with pytest.raises(ValueError) as info:
            build()
        msg = str(info.value)
        assert f"device={device!r}" in msg, (what, msg)
        assert "torch.cuda.is_available() is False" in msg and "expected 'cpu'" in msg, (what, msg)
    # The config alone only parses it: a config file travels between machines.
    assert FusedHeadConfig(backend="ref-test", device=device).device == device


def test_a_cuda_index_past_the_device_count_is_refused(ref_backend, monkeypatch):
    _one_cuda(monkeypatch)
    with pytest.raises(ValueError) as info:
        FusedHead(backend="ref-test", device="cuda:1")
    msg = str(info.value)
    assert "device='cuda:1'" in msg and "torch.cuda.device_count() is 1" in msg, msg
    assert "indices 0..0" in msg, msg
    for device in ("cuda", "cuda:0"):  # those exist
        assert FusedHead(backend="ref-test", device=device).name == "ref-test"


@pytest.mark.parametrize("device", ["mps", "xpu:0", "hpu"])
def test_an_accelerator_type_this_process_lacks_is_refused(ref_backend, device):
    with pytest.raises(ValueError, match=rf"device={device!r} cannot be used in this process"):
        FusedHead(backend="ref-test", device=device)


def test_an_unknown_device_string_names_the_field_or_the_argument(ref_backend):
    with pytest.raises(
        ValueError, match=r"^FusedHeadConfig: field 'device' = 'gpu0' \(str\): must be a torch"
    ):
        FusedHeadConfig(backend="ref-test", device="gpu0")
    with pytest.raises(  # FusedHead's keyword arguments: no FusedHeadConfig the caller built
        ValueError, match=r"^argument 'device' = 'gpu0' \(str\): must be a torch device"
    ):
        FusedHead(backend="ref-test", device="gpu0")


@pytest.mark.parametrize("device", ["cpu", "cpu:0", "meta", None])
def test_cpu_meta_and_the_default_still_resolve(ref_backend, device):
    assert FusedHead(backend="ref-test", device=device).name == "ref-test"


def test_usable_device_names_its_argument():
    from fusedhead.checks import usable_device

    assert usable_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match=r"--device='bogus' is not a torch device string"):
        usable_device("bogus", "--device")


def test_options_changed_after_the_config_was_built_are_validated_not_ignored():
    """Before: a head built from the config ran the options validated at construction (the
    config's resolution reused), so a changed or bad option went unseen."""
    from fusedhead.errors import OptionsError

    config = FusedHeadConfig(backend="torch", options={"workspace_mib": 4})
    assert FusedHead(config).options.workspace_mib == 4
    changed = config.model_copy(update={"options": {"workspace_mib": 8}})  # skips validation
    assert FusedHead(changed).options.workspace_mib == 8
    with pytest.raises(OptionsError, match=r"unknown option 'bogus'"):
        FusedHead(config.model_copy(update={"options": {"bogus": 1}}))
    config.options["chunk_rows"] = "bad"  # the dict changed in place
    with pytest.raises(OptionsError, match=r"option 'chunk_rows' = 'bad'"):
        FusedHead(config)


def test_numpy_bools_are_bools_named_by_their_type():
    """Before: np.True_ was taken as 1.0 for a number option, and a flag's refusal read "must be
    a bool, got bool np.True_" (NumPy's type is named bool too)."""
    np = pytest.importorskip("numpy")
    import torch

    import fusedhead
    from fusedhead.errors import OptionsError

    with pytest.raises(OptionsError, match=r"option 'workspace_mib' = True \(bool\): expected int"):
        FusedHeadConfig(backend="torch", options={"workspace_mib": np.True_})
    assert FusedHeadConfig(options={"skip_ignored_rows": np.False_}).options == {
        "skip_ignored_rows": False
    }
    with pytest.raises(TypeError, match=r"'return_entropy' = np.True_ \(numpy.bool\): expected"):
        FusedHeadConfig(return_entropy=np.True_)
    with pytest.raises(TypeError, match=r"return_entropy must be a bool, got numpy.bool np.True_"):
        fusedhead.fused_head(
            torch.randn(2, 4),
            torch.randn(5, 4),
            torch.zeros(2, dtype=torch.long),
            return_entropy=np.True_,
        )
