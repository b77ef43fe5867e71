"""Broken plugins and bad inputs: each gets an error that names who and what, never a raw crash.

The fault fixtures (tests/fixtures/faults) are installed like real distributions: a hooks plugin
that fails on import, an entry-point name that breaks the name rule, an import of a missing
*name*, and a third party claiming the reserved name ``torch``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel

from fusedhead import diagnostics, fused_head, registry
from fusedhead.diagnostics import Status
from fusedhead.errors import (
    BackendConflictError,
    BackendContractError,
    BackendLoadError,
    BackendUnavailableError,
    IncompatibleBackendError,
    MissingDependencyError,
    UnknownBackendError,
)
from fusedhead.hooks import HookPluginWarning
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput, NoOptions


@pytest.fixture
def with_faults(fault_site: Path, site_on_path: Callable[[Path], Path]) -> Iterator[Path]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HookPluginWarning)
        yield site_on_path(fault_site)


def rows(**kw: Any) -> dict[tuple[str, str | None], diagnostics.BackendListing]:
    return {(r.name, r.distribution): r for r in diagnostics.listing(**kw)}


# --- plugin faults -----------------------------------------------------------------------------


def test_a_hooks_plugin_that_fails_to_import_does_not_break_selection(fault_site, site_on_path):
    from fusedhead import hooks

    with pytest.warns(HookPluginWarning, match="broken-hooks.*fails on import on purpose"):
        site_on_path(fault_site)  # reloads hook plugins if they were loaded already
        hooks.plugin_manager()  # loads them otherwise
    assert "broken-hooks" in hooks.skipped
    out = fused_head(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), backend="good")
    assert out.log_probs.shape == (3,)


def test_a_misnamed_entry_point_is_listed_broken_without_importing_it(with_faults):
    row = rows()[("Bad.Name", "fh-fault-badname")]
    assert row.status is Status.BROKEN
    assert "breaks the name rule" in (row.reason or "")


def test_an_unknown_name_lists_selectable_names_and_a_misnamed_entry_point_apart(with_faults):
    """Before: 'Installed: Bad.Name, good, ...' and 'Did you mean 'Bad.Name'?', a name that can
    never be selected."""
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("bad-name")
    msg = str(info.value)
    installed = re.search(r"Installed: ([^.]*)\.", msg)
    assert installed is not None, msg
    assert "good" in installed.group(1).split(", ") and "Bad" not in installed.group(1), msg
    assert "Did you mean 'Bad.Name'" not in msg, msg
    assert (
        "Not selectable, as their names break the rule (lowercase [a-z0-9_-]+; fusedhead list "
        "shows them): 'Bad.Name' (fh-fault-badname)." in msg
    ), msg


def test_a_third_party_claiming_torch_is_refused_and_the_first_party_one_stays(with_faults):
    listed = rows()
    claim = listed[("torch", "fh-fault-claims-torch")]
    assert claim.status is Status.CONFLICT
    assert "fusedhead-torch" in (claim.reason or "") and "fh-fault-claims-torch" in (
        claim.reason or ""
    )
    assert listed[("torch", "fusedhead-torch")].status is Status.INSTALLED
    assert registry.find("torch").distribution == "fusedhead-torch"


def test_a_missing_name_is_not_reported_as_a_missing_package(with_faults):
    with pytest.raises(BackendLoadError) as info:
        registry.load_class("missing-name")
    assert not isinstance(info.value, MissingDependencyError)
    assert "NoSuchThingInTheProtocol" in str(info.value)
    assert "install the missing package" not in str(info.value)
    assert info.value.distribution == "fh-fault-missing-name"


def test_a_missing_package_names_the_top_level_package(with_fixture_dists):
    with pytest.raises(MissingDependencyError) as info:
        registry.load_class("missing")
    assert info.value.missing == "fh_no_such_package_xyz"
    assert info.value.distribution == "fh-fixture-missing"
    # An import name is no pip name (yaml is PyYAML): the fix is the distribution's reinstall.
    assert "the module 'fh_no_such_package_xyz' is not installed" in info.value.reason
    assert "fh-fixture-missing imports it; its Requires-Dist names no distribution" in (
        info.value.reason
    )
    assert info.value.hint.startswith("reinstall fh-fixture-missing with its dependencies; if ")
    assert "pip install" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "target", "has"),
    [
        ("own-module-gone", "fh_fault_gone_module_xyz", "its top-level modules: "),
        (
            "own-submodule-gone",
            "fh_fault_missing_module.gone",
            "its modules in 'fh_fault_missing_module': declared, dependency_name, own_name, ",
        ),
    ],
)
def test_an_entry_point_naming_a_module_its_distribution_lacks_is_never_a_pip_install_of_it(
    with_faults, name, target, has
):
    """The entry point names a module the distribution's files (its RECORD) never held: a wrong
    entry point, which no reinstall fixes (before: "its install is broken or stale. Fix:
    reinstall"); pip-installing that import name from an index would fetch whatever project has
    the name (a typosquatting risk)."""
    with pytest.raises(BackendLoadError) as info:
        registry.load_class(name)
    err = info.value
    assert not isinstance(err, MissingDependencyError)
    assert (err.backend, err.distribution, err.version) == (
        name,
        "fh-fault-missing-module",
        "1.0.0",
    )
    assert f"names the module {target!r}, which does not exist in fh-fault-missing-module (" in (
        err.reason
    )
    assert has in err.reason
    assert "broken or stale" not in str(err)
    hint = err.hint or ""
    assert "the entry point in the metadata of fh-fault-missing-module is wrong" in hint
    if "." in target:  # in its own regular package, where no other distribution puts a module
        assert "reinstalling it as it is never fixes that" in hint
        assert "pip install" not in str(err)
    else:  # a top-level module its declared, uninstalled requirement may provide: named first
        assert hint.startswith("pip install 'fh-fault-declared-dep-xyz>=2.0' (its Requires-Dist)")
        assert "pip install 'fh_fault" not in str(err)


def test_a_name_its_own_package_lacks_is_its_install_or_its_code_never_a_version_mismatch(
    with_faults,
):
    """Before: "the installed packages do not match what it was built for; upgrade fusedhead
    and the backend together", for an import of a name the plugin's own package lacks."""
    with pytest.raises(BackendLoadError) as info:
        registry.load_class("own-name-gone")
    err = info.value
    assert "no_such_name_xyz" in err.reason
    assert "a name its own package 'fh_fault_missing_module' lacks" in err.reason
    assert err.hint == (
        "reinstall fh-fault-missing-module; if the error stays, report it to the authors of "
        "fh-fault-missing-module"
    )
    assert "upgrade fusedhead" not in str(err)


def test_a_name_an_installed_module_lacks_names_that_module(with_faults):
    with pytest.raises(BackendLoadError) as info:
        registry.load_class("dependency-lacks-name")
    err = info.value
    assert "the installed 'json' lacks a name fh-fault-missing-module uses" in err.reason
    assert "upgrade fusedhead" not in str(err)


def test_selecting_a_misnamed_entry_point_names_its_distribution(with_faults):
    """Before: "backend name 'Bad.Name' is not valid ... did you mean 'bad-name'?" or another
    backend's name, never the distribution that must rename it."""
    with pytest.raises(BackendLoadError) as info:
        registry.load_class("Bad.Name")
    err = info.value
    assert (err.backend, err.distribution) == ("Bad.Name", "fh-fault-badname")
    assert "breaks the name rule" in err.reason and "must rename it" in err.reason
    assert "did you mean" not in str(err)


def test_a_missing_dependency_names_a_pip_package_only_from_the_distributions_requires_dist(
    with_faults,
):
    with pytest.raises(MissingDependencyError) as declared:
        registry.load_class("declared-dep-missing")
    assert declared.value.missing == "fh_fault_declared_dep_xyz"
    assert declared.value.hint == (
        "pip install 'fh-fault-declared-dep-xyz>=2.0' (its Requires-Dist), or reinstall "
        "fh-fault-missing-module with its dependencies"
    )
    with pytest.raises(MissingDependencyError) as undeclared:
        registry.load_class("undeclared-dep-missing")
    assert undeclared.value.missing == "fh_fault_undeclared_dep_xyz"
    # Not in its Requires-Dist: reinstalling may not bring it (before: "a dependency of" it,
    # and "reinstall" the only fix); the authors are told of the missing requirement.
    assert "a dependency of" not in undeclared.value.reason
    assert "its Requires-Dist names no distribution 'fh_fault_undeclared_dep_xyz'" in (
        undeclared.value.reason
    )
    assert undeclared.value.hint == (
        "reinstall fh-fault-missing-module with its dependencies; if "
        "'fh_fault_undeclared_dep_xyz' is still missing, install the package that provides it "
        "(its pip name may differ) and report the missing requirement to the authors of "
        "fh-fault-missing-module"
    )
    assert "pip install" not in str(undeclared.value)


def test_list_check_shows_incompatible_and_misnamed_plugins_with_their_reason(
    with_faults, fixture_site
):
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(with_faults), str(fixture_site)])}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from fusedhead.cli import main; sys.exit(main(sys.argv[1:]))",
            "list",
            "--check",
            "--device",
            "cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    listed = {(r["name"], r["distribution"]): r for r in json.loads(proc.stdout)}
    assert listed[("incompatible", "fh-fixture-incompatible")]["status"] == "incompatible"
    # the reason, a sentence, then the fix that says which side to upgrade
    assert listed[("incompatible", "fh-fixture-incompatible")]["reason"].startswith(
        "speaks plugin API version 99; this fusedhead speaks version 2. Fix: the backend needs a "
        "newer fusedhead"
    )
    assert listed[("Bad.Name", "fh-fault-badname")]["status"] == "broken"
    assert "name rule" in listed[("Bad.Name", "fh-fault-badname")]["reason"]
    assert listed[("torch", "fh-fault-claims-torch")]["status"] == "conflict"


# --- the class's shape, checked at load ----------------------------------------------------------


class _Shape:
    name: ClassVar[str] = "shape-test"
    Options: ClassVar[type[BaseModel]] = NoOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: NoOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities()

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def forward(self, call: HeadCall) -> HeadOutput:
        raise AssertionError("not called")


def _variant(**attrs: Any) -> type:
    return type("Variant", (_Shape,), attrs)


def _lacking(attr: str) -> type:
    """A class shaped like ``_Shape`` but without the class attribute ``attr``."""
    body = {k: v for k, v in vars(_Shape).items() if k not in (attr, "__dict__", "__weakref__")}
    return type("Variant", (), body)


class _LooseOptions(BaseModel):  # no extra="forbid": a typo in an option would pass silently
    chunk: int = 1024


SHAPE_FAULTS = {
    "v1-forward": (
        _variant(forward=lambda self, hidden, weight, labels, **kw: None),
        BackendLoadError,
        "forward",
    ),
    "check-params": (_variant(check=lambda self, device: None), BackendLoadError, "check"),
    "no-capabilities": (_variant(capabilities=None), BackendLoadError, "capabilities"),
    "v1": (_variant(plugin_api_version=1), IncompatibleBackendError, "version 1"),
    "str-version": (
        _variant(plugin_api_version="2"),
        BackendLoadError,
        r"Variant\.plugin_api_version must be an int, got str '2'",
    ),
    "float-version": (
        _variant(plugin_api_version=2.0),
        BackendLoadError,
        r"plugin_api_version must be an int, got float 2\.0",
    ),
    "bool-version": (  # a bool is an int subclass: True is no version
        _variant(plugin_api_version=True),
        BackendLoadError,
        "plugin_api_version must be an int, got bool True",
    ),
    "no-version": (
        _lacking("plugin_api_version"),
        BackendLoadError,
        r"Variant does not define plugin_api_version \(a class attribute: the plugin API "
        r"version it speaks, 2\)",
    ),
    "no-options": (_lacking("Options"), BackendLoadError, "Variant does not define Options"),
    "options-not-model": (_variant(Options=dict), BackendLoadError, "Options"),
    "options-not-forbidding-extra": (
        _variant(Options=_LooseOptions),
        BackendLoadError,
        r"Variant\.Options must forbid extra fields",
    ),
    # optional capabilities' methods: before, checked only by their first call's raw TypeError
    "policy-loss-params": (
        _variant(policy_loss=lambda self: None),
        BackendLoadError,
        r"Variant\.policy_loss\(self\) does not take \(call\)",
    ),
    "kl-params": (
        _variant(kl=lambda self, student, teacher: None),
        BackendLoadError,
        r"Variant\.kl\(self, student, teacher\) does not take \(call\)",
    ),
}


@pytest.mark.parametrize(("cls", "error", "pattern"), SHAPE_FAULTS.values(), ids=SHAPE_FAULTS)
def test_a_class_whose_shape_breaks_the_plugin_api_is_refused_at_registration(cls, error, pattern):
    """register_backend runs the loader's shape check: before, such a class registered and failed
    only at its first call (a str version read as 'speaks plugin API version '2'; ... 2..2')."""
    with pytest.raises(error, match=pattern) as info:
        registry.register_backend("shape-test", cls)
    assert info.value.backend == "shape-test" and info.value.hint
    assert "shape-test" not in registry.candidates()  # nothing was registered


@pytest.mark.parametrize(("cls", "error", "pattern"), SHAPE_FAULTS.values(), ids=SHAPE_FAULTS)
def test_the_entry_point_loader_refuses_the_same_shapes_naming_the_distribution(
    cls, error, pattern
):
    fields = {"backend": "shape-test", "distribution": "acme-shapes", "version": "0.1"}
    with pytest.raises(error, match=pattern) as info:
        registry.verify_backend_class(cls, **fields)
    assert str(info.value).startswith("backend 'shape-test' (acme-shapes 0.1): ")


def _a_function() -> None: ...


@pytest.mark.parametrize(
    ("named", "got"),
    [
        (_variant(), "an instance of Variant"),  # before: "got Variant", as if it were the class
        (_a_function, "the function '_a_function'"),
        (pytest, "the module 'pytest'"),
    ],
    ids=["instance", "function", "module"],
)
def test_an_entry_point_that_names_no_class_says_what_it_names(named, got):
    fields = {"backend": "shape-test", "distribution": "acme-shapes", "version": "0.1"}
    target = object.__new__(named) if isinstance(named, type) else named
    with pytest.raises(BackendLoadError) as info:
        registry.verify_backend_class(target, **fields)
    assert f"the entry point must name a class, got {got}" in str(info.value), str(info.value)


def test_reserved_names_cannot_be_registered_in_process():
    with pytest.raises(BackendConflictError, match="reserved"):
        registry.register_backend("torch", _variant(name="torch"))


def test_refresh_and_unregister_leave_no_stale_head(inputs):
    first = _variant(
        forward=lambda self, call: HeadOutput(call.hidden.new_zeros(call.labels.shape[0]).float())
    )
    second = _variant(
        forward=lambda self, call: HeadOutput(call.hidden.new_ones(call.labels.shape[0]).float())
    )
    h, w, y = inputs()
    registry.register_backend("shape-test", first)
    try:
        assert fused_head(h, w, y, backend="shape-test", return_entropy=False).log_probs.sum() == 0
    finally:
        registry.unregister_backend("shape-test")
    registry.register_backend("shape-test", second)
    try:
        assert fused_head(
            h, w, y, backend="shape-test", return_entropy=False
        ).log_probs.sum() == len(y)
    finally:
        registry.unregister_backend("shape-test")


# --- a backend that misbehaves at run time --------------------------------------------------------


def test_check_raising_a_plain_error_becomes_a_contract_error(ref_backend, inputs, monkeypatch):
    def bad_check(self, device, dtype):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(ref_backend, "check", bad_check)
    with pytest.raises(
        BackendContractError, match="check\\(\\) raised RuntimeError: driver exploded"
    ) as info:
        fused_head(*inputs(), backend="ref-test")
    assert info.value.backend == "ref-test" and "BackendUnavailableError" in (info.value.hint or "")


def test_check_raising_unavailable_carries_the_backend(ref_backend, inputs, monkeypatch):
    def no(self, device, dtype):
        raise BackendUnavailableError("no such device here", hint="use cpu")

    monkeypatch.setattr(ref_backend, "check", no)
    with pytest.raises(BackendUnavailableError) as info:
        fused_head(*inputs(), backend="ref-test")
    assert str(info.value) == "backend 'ref-test': no such device here. Fix: use cpu"


def _outputs(n: int, like: torch.Tensor) -> dict[str, Callable[[], object]]:
    good = (like.float().sum(-1) * 0)[:n]
    return {
        "3-tuple": lambda: (good, good, good),
        "None": lambda: None,
        "v1 pair": lambda: (good, good),
        "meta": lambda: HeadOutput(torch.zeros(n, device="meta"), torch.zeros(n, device="meta")),
        "detached": lambda: HeadOutput(good.detach(), good.detach()),
        "float64": lambda: HeadOutput(good.double(), good.double()),
        "wrong length": lambda: HeadOutput(good[:-1], good[:-1]),
        "entropy missing": lambda: HeadOutput(good),
        "2-d": lambda: HeadOutput(good.unsqueeze(0), good.unsqueeze(0)),
    }


@pytest.mark.parametrize("kind", list(_outputs(1, torch.zeros(1, 1))))
def test_a_backend_breaking_the_output_contract_is_caught(ref_backend, inputs, monkeypatch, kind):
    h, w, y = inputs()
    h.requires_grad_(True)
    make = _outputs(len(y), h)[kind]
    monkeypatch.setattr(ref_backend, "forward", lambda self, call: make())
    with pytest.raises(BackendContractError, match="broke the plugin contract") as info:
        fused_head(h, w, y, backend="ref-test")
    assert info.value.backend == "ref-test"


# --- a plugin whose __init__ or capabilities() is broken ---------------------------------------


def _init_raises(self: Any, options: Any) -> None:
    raise RuntimeError("weights file missing")


#: Each fault, the method to replace, its replacement, and what the error must say.
PLUGIN_BUGS: dict[str, tuple[str, Any, str]] = {
    "capabilities returns a dict": (
        "capabilities",
        lambda self, device: {"devices": ("cpu",)},
        r"capabilities\(\w+\) must return fusedhead\.protocol\.Capabilities, got dict",
    ),
    "capabilities builds invalid Capabilities": (
        "capabilities",
        lambda self, device: Capabilities(dtypes=("float32",)),
        r"capabilities\(\w+\) raised ValidationError building Capabilities: dtypes\.0: .*"
        r"\(got 'float32'\)",
    ),
    "capabilities without log_probs": (
        "capabilities",
        lambda self, device: Capabilities(outputs=("entropy",)),
        r"outputs must include 'log_probs'",
    ),
    "capabilities with topk and no max_top_k": (
        "capabilities",
        lambda self, device: Capabilities(outputs=("log_probs", "topk")),
        r"outputs include 'topk', so max_top_k must be .* got 0",
    ),
    "capabilities with a flag given as text": (
        "capabilities",
        lambda self, device: Capabilities(deterministic="yes"),
        r"deterministic: Input should be a valid boolean \(got 'yes'\)",
    ),
    # Misspelt names read as "not declared" (and the kit's property as "not run"), silently.
    "capabilities with a misspelt output": (
        "capabilities",
        lambda self, device: Capabilities(outputs=("log_probs", "arg_max")),
        r"outputs must be among \[.*'argmax'.*\], got \['arg_max'\]",
    ),
    "capabilities with an unknown KL direction": (
        "capabilities",
        lambda self, device: Capabilities(kl_directions=("sideways",)),
        r"kl_directions must be among \['forward', 'reverse'\], got \['sideways'\]",
    ),
    "capabilities with a device torch does not know": (
        "capabilities",
        lambda self, device: Capabilities(devices=("gpu",)),
        r"devices must be torch device types .* got 'gpu'",
    ),
    # A declaration without its method failed only when first called.
    "policy_loss declared without the method": (
        "capabilities",
        lambda self, device: Capabilities(policy_loss=True),
        r"declares policy_loss but the backend has no policy_loss\(call\) method",
    ),
    "kl_directions declared without the method": (
        "capabilities",
        lambda self, device: Capabilities(kl_directions=("forward",)),
        r"declares kl but the backend has no kl\(call\) method",
    ),
    "__init__ raises": (
        "__init__",
        _init_raises,
        r"__init__\(options\) raised RuntimeError: weights file missing",
    ),
}


#: Breaches the core finds in what the plugin returned, with no exception of the plugin's.
UNCHAINED = {
    "capabilities returns a dict",
    "policy_loss declared without the method",
    "kl_directions declared without the method",
}


@pytest.fixture
def good_class(with_fixture_dists: Path) -> type:
    """The installed fixture backend 'good' (fh-fixture-good 1.0.0), to break per test."""
    cls: type = registry.load_class("good")
    return cls


def _assert_names_the_plugin(err: dict[str, Any], pattern: str) -> None:
    """``err`` (an error's ``to_dict()``): a contract error naming the plugin and the breach."""
    assert err["error"] == "BackendContractError" and err["status"] == "broken", err
    assert (err["backend"], err["distribution"], err["version"]) == (
        "good",
        "fh-fixture-good",
        "1.0.0",
    )
    assert re.search(pattern, err["reason"]), err["reason"]
    assert "report this to the backend's authors" in (err["hint"] or "")
    assert err["message"].startswith("backend 'good' (fh-fixture-good 1.0.0): ")


@pytest.mark.parametrize("bug", list(PLUGIN_BUGS))
@pytest.mark.parametrize("how", ["fused_head", "FusedHead", "get_fused_head"])
def test_a_plugins_own_bug_at_selection_is_a_contract_error_naming_its_distribution(
    good_class, inputs, monkeypatch, bug, how
):
    from fusedhead import FusedHead
    from fusedhead.api import get_fused_head

    method, replacement, pattern = PLUGIN_BUGS[bug]
    monkeypatch.setattr(good_class, method, replacement)
    select = {
        "fused_head": lambda: fused_head(*inputs(), backend="good"),
        "FusedHead": lambda: FusedHead(backend="good", device="cpu"),
        "get_fused_head": lambda: get_fused_head("good"),
    }[how]
    with pytest.raises(BackendContractError) as info:
        select()
    _assert_names_the_plugin(info.value.to_dict(), pattern)
    if bug not in UNCHAINED:  # a raise is chained from the plugin's exception
        assert isinstance(info.value.__cause__, Exception)
        assert not isinstance(info.value.__cause__, BackendContractError)


@pytest.mark.parametrize("bug", list(PLUGIN_BUGS))
def test_a_plugins_own_bug_makes_fusedhead_check_and_info_name_its_distribution(
    good_class, monkeypatch, capsys, bug
):
    from fusedhead import cli

    method, replacement, pattern = PLUGIN_BUGS[bug]
    monkeypatch.setattr(good_class, method, replacement)
    # exit 2: an error resolving the backend; 1 would say a property of the kit failed
    assert cli.main(["check", "good", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fusedhead: error: backend 'good' (fh-fixture-good 1.0.0): "), err
    assert "unexpected failure" not in err
    assert cli.main(["info", "good", "--device", "cpu", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["status"] == "broken"
    _assert_names_the_plugin(info["error"], pattern)
    listed = rows(probe=True, device="cpu")[("good", "fh-fixture-good")]
    assert listed.status is Status.BROKEN
    assert re.search(pattern, listed.reason or ""), listed.reason


def test_fusedhead_check_wraps_a_raw_exception_from_check_as_a_call_does(
    good_class, inputs, monkeypatch, capsys
):
    """The kit resolves the backend through the core's wrapper: the same BackendContractError
    as a call, naming the distribution, and exit 2 (an error), not 1 (a property failed)."""
    from fusedhead import cli

    def no_driver(self: Any, device: torch.device, dtype: torch.dtype) -> None:
        raise RuntimeError("CUDA driver not found")

    monkeypatch.setattr(good_class, "check", no_driver)
    with pytest.raises(BackendContractError) as called:
        fused_head(*inputs(), backend="good")
    assert cli.main(["check", "good", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fusedhead: error: {called.value}"
    assert "(fh-fixture-good 1.0.0): check() raised RuntimeError: CUDA driver not found" in err
    # list --check and info word it as the call does (was 'probe failed: RuntimeError: ...')
    listed = rows(probe=True, device="cpu")[("good", "fh-fixture-good")]
    assert listed.status is Status.BROKEN
    assert (listed.reason or "").startswith("check() raised RuntimeError: CUDA driver not found")
    assert "report this to the backend's authors" in (listed.reason or "")


def test_fusedhead_check_on_a_dtype_the_backend_does_not_declare_names_its_distribution(
    good_class, monkeypatch, capsys
):
    """The audit saw "backend 'NAME' does not take fp16 inputs" without the distribution; the kit
    now resolves through the core's gate, whose error names it as a call's does."""
    from fusedhead import cli

    def fp32_only(self: Any, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu",), dtypes=("fp32",))

    monkeypatch.setattr(good_class, "capabilities", fp32_only)
    assert cli.main(["check", "good", "--device", "cpu", "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "fusedhead: error: backend 'good' (fh-fixture-good 1.0.0): does not take torch.float16 "
        "inputs (it declares ['fp32']). Fix: cast hidden and weight to one of ['fp32']"
    )


# --- bad inputs ----------------------------------------------------------------------------------


def test_a_meta_device_call_is_refused_by_the_backend_not_inside_autocast():
    h = torch.randn(4, 8, device="meta")
    w = torch.randn(16, 8, device="meta")
    y = torch.zeros(4, dtype=torch.long, device="meta")
    with pytest.raises(BackendUnavailableError, match="meta") as info:
        fused_head(h, w, y, backend="torch")
    assert info.value.backend == "torch" and info.value.distribution == "fusedhead-torch"


def test_a_meta_device_call_runs_on_a_backend_that_declares_meta(ref_backend):
    h = torch.randn(4, 8, device="meta")
    w = torch.randn(16, 8, device="meta")
    y = torch.zeros(4, dtype=torch.long, device="meta")
    out = fused_head(h, w, y, backend="ref-test")
    assert out.log_probs.device.type == "meta" and out.log_probs.shape == (4,)


@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), float("nan"), 0, -1.0])
def test_an_out_of_range_temperature_is_a_value_error_naming_it(inputs, value):
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        fused_head(*inputs(), backend="torch", temperature=value)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**400])
def test_an_ignore_index_beyond_int64_is_a_value_error_naming_it(inputs, value):
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        fused_head(*inputs(), backend="torch", ignore_index=value)


@pytest.mark.parametrize("value", [10**400, float("inf")])
def test_an_out_of_range_softcap_is_a_value_error_naming_it(inputs, value):
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        fused_head(*inputs(), backend="torch", softcap=value)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_a_raw_exception_from_forward_keeps_its_type_and_names_the_backend(
    good_class, inputs, monkeypatch
):
    """forward's own bug (or an out-of-memory) is not a contract breach to rewrap: its type
    stays, and a note names the backend and distribution it came from."""

    def forward(self: Any, call: Any) -> Any:
        raise IndexError("index 3 is out of bounds")

    monkeypatch.setattr(good_class, "forward", forward)
    with pytest.raises(IndexError, match="index 3 is out of bounds") as info:
        fused_head(*inputs(), backend="good")
    notes = getattr(info.value, "__notes__", [])
    assert notes == ["raised inside fusedhead backend 'good' (fh-fixture-good 1.0.0)"], notes


def test_a_plugin_exiting_at_import_is_a_load_error_naming_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's ``sys.exit()`` at import is its bug, reported as one: before, the SystemExit
    ended ``fusedhead list --check`` (and any call selecting it) with the plugin's exit code."""
    import importlib.metadata as md

    (tmp_path / "fh_exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = md.EntryPoint("exits", "fh_exits_at_import:Backend", registry.ENTRY_POINT_GROUP)
    cand = registry.Candidate("exits", ep.value, "acme-exits", "0.1", entry_point=ep)
    with pytest.raises(BackendLoadError, match=r"failed to import: SystemExit: 3") as info:
        registry.load_candidate(cand)
    assert str(info.value).startswith("backend 'exits' (acme-exits 0.1): ")
