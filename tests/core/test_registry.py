"""The registry: discovery from real installed distributions, strict selection by exact name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fusedhead import diagnostics, install_hints, registry
from fusedhead.diagnostics import Status
from fusedhead.errors import (
    BackendConflictError,
    BackendLoadError,
    IncompatibleBackendError,
    MissingDependencyError,
    UnknownBackendError,
)

FIXTURES = {"good", "broken", "missing", "incompatible", "dup"}


def rows_by_name(**kw):
    return {r.name: r for r in diagnostics.listing(**kw) if r.name in FIXTURES}


def test_listing_reads_metadata_and_imports_nothing(with_fixture_dists):
    rows = rows_by_name()
    assert {"good", "broken", "missing", "incompatible"} <= set(rows)
    assert rows["good"].status is Status.INSTALLED
    assert rows["good"].distribution == "fh-fixture-good" and rows["good"].version == "1.0.0"
    assert rows["broken"].status is Status.INSTALLED, (
        "a broken plugin is only seen as broken when probed"
    )
    assert not [m for m in sys.modules if m.startswith("fh_fixture_")]


def test_two_distributions_claiming_a_name_are_both_listed_as_conflict(with_fixture_dists):
    dups = [r for r in diagnostics.listing() if r.name == "dup"]
    assert {r.distribution for r in dups} == {"fh-fixture-dup-a", "fh-fixture-dup-b"}
    assert all(r.status is Status.CONFLICT for r in dups)


def test_selecting_a_conflicting_name_names_both_distributions(with_fixture_dists):
    with pytest.raises(BackendConflictError) as info:
        registry.load_class("dup")
    assert "fh-fixture-dup-a" in str(info.value) and "fh-fixture-dup-b" in str(info.value)


def test_selection_imports_only_the_selected_backend(with_fixture_dists):
    cls = registry.load_class("good")
    assert cls.name == "good"
    loaded = {m for m in sys.modules if m.startswith("fh_fixture_")}
    assert loaded == {"fh_fixture_good"}


def test_broken_plugin_reports_distribution_version_and_cause(with_fixture_dists):
    with pytest.raises(BackendLoadError) as info:
        registry.load_class("broken")
    msg = str(info.value)
    assert "fh-fixture-broken 1.0.0" in msg and "fails on import on purpose" in msg


def test_missing_dependency_names_the_module(with_fixture_dists):
    with pytest.raises(MissingDependencyError, match="fh_no_such_package_xyz"):
        registry.load_class("missing")


def test_incompatible_plugin_api_is_refused(with_fixture_dists):
    with pytest.raises(IncompatibleBackendError, match="plugin API version 99") as info:
        registry.load_class("incompatible")
    assert "upgrade fusedhead to one that speaks plugin API 99" in str(info.value)


def test_an_older_plugin_api_says_to_upgrade_the_backend() -> None:
    """A backend older than the core is told to upgrade the backend, not fusedhead."""

    class Old:
        plugin_api_version = 1

    with pytest.raises(IncompatibleBackendError) as info:
        registry.verify_backend_class(Old)
    assert "this fusedhead speaks version 2" in str(info.value)
    assert "the backend is older than this fusedhead: upgrade its distribution" in str(info.value)


def test_probe_gives_each_status_and_isolates_broken_plugins(with_fixture_dists):
    rows = rows_by_name(probe=True, device="cpu")
    assert rows["good"].status is Status.OK
    assert rows["broken"].status is Status.BROKEN
    assert rows["broken"].distribution == "fh-fixture-broken"
    assert "fails on import on purpose" in (rows["broken"].reason or "")
    assert rows["missing"].status is Status.BROKEN
    assert rows["incompatible"].status is Status.INCOMPATIBLE


def test_unknown_name_lists_installed_and_suggests(with_fixture_dists):
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("godo")
    msg = str(info.value)
    assert "'godo'" in msg and "good" in msg and "Did you mean 'good'?" in msg


def _not_installed(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Discovery as on a machine without the first-party backend ``name`` (the dev venv has it)."""
    installed = registry.installed_entry_points
    monkeypatch.setattr(
        registry,
        "installed_entry_points",
        lambda: tuple(c for c in installed() if c.name != name),
    )


def test_unknown_first_party_name_says_how_to_install_it(with_fixture_dists, monkeypatch):
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "good")
    _not_installed(monkeypatch, "liger")
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("liger")
    assert install_hints.install_command("liger") in str(info.value)
    assert "fusedhead-liger" in str(info.value)
    assert "FUSEDHEAD_BACKENDS" in str(info.value)


REPO = Path(__file__).resolve().parents[2]


def _pip_targets(message: str) -> list[str]:
    """What each `pip install ...` in ``message`` asks for (its last argument, quotes dropped)."""
    return [
        re.split(r"\s+", cmd.strip())[-1].rstrip(",.").strip("'\"")
        for cmd in re.findall(r"pip install ((?:--find-links \S+ )?'[^']+'|\S+)", message)
    ]


@pytest.mark.parametrize("name", ["triton", "liger"])
def test_uninstalled_first_party_backend_gets_a_pip_command_that_works_before_pypi(
    name, with_fixture_dists, monkeypatch
):
    """Nothing is on PyPI: `pip install 'fusedhead[NAME]'` alone finds no fusedhead-NAME there.

    The advice is a folder of this clone holding the distribution, or --find-links with the
    wheels; an install from this clone (the dev venv: editable) names this clone's folder.
    """
    assert install_hints.ON_PYPI is False
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "good")
    _not_installed(monkeypatch, name)
    dist = registry.RESERVED_NAMES[name]
    for root in (str(REPO), None):  # installed from this clone; from wheels (no clone known)
        monkeypatch.setattr(install_hints, "source_checkout", lambda root=root: root)
        with pytest.raises(UnknownBackendError) as info:
            registry.load_class(name)
        msg = str(info.value)
        targets = _pip_targets(msg)
        assert targets, msg
        for target in targets:
            if target.startswith("fusedhead["):  # from the index: only with the built wheels
                assert f"--find-links dist '{target}'" in msg and "build-dists" in msg, msg
                continue
            folder = Path(target) if root else REPO / target
            project = (folder / "pyproject.toml").read_text()
            assert f'name = "{dist}"' in project, (target, msg)
            if root:
                assert folder.is_absolute() and str(folder).startswith(str(REPO)), msg
        with pytest.raises(UnknownBackendError) as close:
            registry.load_class(name[:-1] + "x")  # a near miss: "Did you mean ..."
        assert install_hints.install_command(name) in str(close.value)


def test_once_on_pypi_the_advice_is_the_extra(monkeypatch):
    monkeypatch.setattr(install_hints, "ON_PYPI", True)
    assert install_hints.install_command("triton") == "pip install 'fusedhead[triton]'"


@pytest.mark.parametrize(
    ("extra", "wanted"),
    [("testing", "'hypothesis>=6'"), ("yaml", "'pyyaml>=6'"), ("bench", "'matplotlib>=3.7'"),
     ("transformers", "'transformers>=4.45'")],
)  # fmt: skip
def test_an_extras_advice_names_its_packages_until_fusedhead_is_on_pypi(monkeypatch, extra, wanted):
    """Before the first upload ``fusedhead[EXTRA]`` would look for fusedhead on the index: the
    advice is the extra's own requirements, from the core's metadata; after it, the extra."""
    command = install_hints.extra_command(extra)
    assert command.startswith("pip install ") and wanted in command and "fusedhead[" not in command
    monkeypatch.setattr(install_hints, "ON_PYPI", True)
    assert install_hints.extra_command(extra) == f"pip install 'fusedhead[{extra}]'"


def test_source_checkout_is_the_clone_of_an_install_from_source():
    # The dev venv installs ./core editable (scripts/setup.sh): direct_url.json names this clone.
    assert install_hints.source_checkout() == str(REPO)


def test_environment_limits_discovery(with_fixture_dists, monkeypatch):
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "good,broken")
    assert {r.name for r in diagnostics.listing()} == {"good", "broken"}
    with pytest.raises(UnknownBackendError):
        registry.load_class("incompatible")


def test_same_distribution_twice_on_path_is_no_conflict(
    with_fixture_dists, install_fixture_dist, tmp_path, monkeypatch
):
    install_fixture_dist(tmp_path, "good")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh()
    goods = [r for r in diagnostics.listing() if r.name == "good"]
    assert len(goods) == 1 and goods[0].status is Status.INSTALLED
    assert registry.load_class("good").name == "good"


@pytest.mark.parametrize("name", ["Torch", "my backend", "", "a.b"])
def test_names_follow_the_entry_point_rule(name):
    class B:
        pass

    B.name = name  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not valid"):
        registry.register_backend(name, B)


def test_names_must_be_strings():
    with pytest.raises(TypeError, match="backend"):
        registry.find(3)  # type: ignore[arg-type]


def test_in_process_registration_follows_the_same_rules(with_fixture_dists, ref_backend):
    with pytest.raises(BackendConflictError, match="fh-fixture-good"):
        registry.register_backend("good", type("X", (), {"name": "good"}))
    with pytest.raises(BackendConflictError, match="already registered"):
        registry.register_backend("ref-test", ref_backend)
    with pytest.raises(ValueError, match="class attribute"):
        registry.register_backend("other", ref_backend)
    assert registry.load_class("ref-test") is ref_backend
    row = next(r for r in diagnostics.listing() if r.name == "ref-test")
    assert row.distribution is None and row.status is Status.INSTALLED


def test_a_class_that_breaks_the_plugin_api_is_refused_where_it_is_registered():
    """Before: registered, then refused only at the first call (load_class)."""
    from pydantic import BaseModel

    class Loose(BaseModel):
        pass

    class Bad:
        name = "bad-api"
        Options = Loose
        plugin_api_version = 2

    with pytest.raises(BackendLoadError, match=r"Bad\.Options must forbid extra fields") as info:
        registry.register_backend("bad-api", Bad)
    assert info.value.hint == "set model_config = ConfigDict(extra='forbid', frozen=True)"
    with pytest.raises(UnknownBackendError):
        registry.load_class("bad-api")


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from fusedhead.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules or sys.argv[1] != 'list' or '--check' in sys.argv, 'list imported torch'; "
        "sys.exit(rc)"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, **kw)


def test_cli_list_json_and_no_torch_import(with_fixture_dists):
    proc = run_cli("list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout) if r["name"] in FIXTURES}
    assert rows["good"] == {
        "name": "good",
        "distribution": "fh-fixture-good",
        "version": "1.0.0",
        "entry_point": "fh_fixture_good:Backend",
        "status": "installed",
    }
    assert rows["dup"]["status"] == "conflict" and "reason" in rows["dup"]


def test_cli_list_check_exits_1_on_broken_plugins(with_fixture_dists):
    proc = run_cli("list", "--check", "--device", "cpu")
    assert proc.returncode == 1
    assert "broken" in proc.stdout and "fh-fixture-broken" in proc.stdout
    table = proc.stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "DISTRIBUTION", "VERSION", "STATUS"]


def test_cli_list_json_with_no_backends_installed_prints_empty_list():
    src = Path(registry.__file__).resolve().parents[1]
    code = f"import sys; sys.path.insert(0, {str(src)!r}); from fusedhead.cli import main; sys.exit(main(['list', '--json']))"
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_cli_unknown_name_exits_nonzero_with_the_message(with_fixture_dists):
    proc = run_cli("info", "godo")
    assert proc.returncode == 2
    assert "Did you mean 'good'?" in proc.stderr


def test_cli_info_shows_capabilities_and_options(with_fixture_dists):
    proc = run_cli("info", "good", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["status"] == "ok" and info["distribution"] == "fh-fixture-good"
    assert info["capabilities"]["deterministic"] is True
    assert info["options_schema"] == [
        {"name": "scale_check", "type": "int", "default": 1, "description": "", "required": False}
    ]


def test_import_fusedhead_imports_no_torch():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import fusedhead, sys; assert 'torch' not in sys.modules; assert 'pydantic' not in sys.modules",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_installed_entry_points_ignore_the_allowlist_and_in_process_names(
    with_fixture_dists, ref_backend, monkeypatch
):
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "good")
    assert set(registry.candidates()) == {"good"}
    installed = registry.installed_entry_points()
    names = {c.name for c in installed}
    assert {"good", "broken", "missing", "incompatible", "dup", "torch"} <= names
    assert "ref-test" not in names  # registered in-process, not installed
    dups = sorted(c.distribution or "" for c in installed if c.name == "dup")
    assert dups == ["fh-fixture-dup-a", "fh-fixture-dup-b"]
    assert [c.name for c in installed] == sorted(c.name for c in installed)
    assert all(c.distribution and c.version for c in installed)
    assert not [m for m in sys.modules if m.startswith("fh_fixture_")]


def test_probe_backend_gives_the_status_and_reason_without_raising(with_fixture_dists):
    cands = {c.name: c for c in registry.installed_entry_points()}
    assert diagnostics.probe_backend(cands["good"], "cpu") == (Status.OK, None)
    status, reason = diagnostics.probe_backend(cands["broken"])
    assert status is Status.BROKEN and "fails on import on purpose" in (reason or "")
    assert diagnostics.probe_backend(cands["incompatible"], "cpu")[0] is Status.INCOMPATIBLE
    assert diagnostics.probe_backend(cands["missing"], "cpu")[0] is Status.BROKEN
    rows = rows_by_name(probe=True, device="cpu")
    for name in ("good", "broken", "incompatible", "missing"):
        assert (rows[name].status, rows[name].reason) == diagnostics.probe_backend(
            cands[name], "cpu"
        )


def test_an_installed_backend_hidden_by_the_limit_is_named_as_hidden_not_missing(
    with_fixture_dists, monkeypatch
):
    """FUSEDHEAD_BACKENDS hides an installed backend: the fix is the variable, not a pip install."""
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "good")
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("torch")
    msg = str(info.value)
    assert "Available under FUSEDHEAD_BACKENDS='good': good." in msg, msg  # not "Installed: good"
    assert "'torch' is installed, but FUSEDHEAD_BACKENDS hides it" in msg, msg
    assert "pip install" not in msg, msg


@pytest.mark.parametrize("typo", ["torhc", "god"])
def test_a_near_miss_of_a_hidden_backend_is_suggested_as_hidden_not_missing(
    typo, with_fixture_dists, monkeypatch
):
    """Before: "Did you mean 'torch' (not installed: pip install ...)?" for an installed torch that
    FUSEDHEAD_BACKENDS hid (and a hidden third-party name was not suggested at all). Now a near
    miss gets the advice an exact hidden name gets: the variable, not a pip install."""
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "broken")
    meant = {"torhc": "torch", "god": "good"}[typo]
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class(typo)
    msg = str(info.value)
    want = f"Did you mean {meant!r} (installed, but FUSEDHEAD_BACKENDS hides it: add {meant!r} "
    assert want in msg, msg
    assert "not installed" not in msg and "pip install" not in msg, msg


def test_a_limit_name_that_selects_nothing_is_named_with_what_it_meant(
    with_fixture_dists, monkeypatch
):
    """Before: FUSEDHEAD_BACKENDS=TORCH hid torch and the error said only that torch was hidden,
    never that the variable's own 'TORCH' matches nothing; a wrong-case name asked for was "not
    installed: pip install ..." though installed. Now both point at the variable's typo."""
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "TORCH,good")
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("torch")
    msg = str(info.value)
    assert (
        "FUSEDHEAD_BACKENDS names 'TORCH', which nothing here provides (did you mean 'torch'?)"
        in msg
    ), msg
    assert "names 'good'" not in msg, msg  # a name that selects something is no stray
    with pytest.raises(ValueError) as info:
        registry.load_class("TORCH")
    msg = str(info.value)
    assert "did you mean 'torch'? It is installed, but FUSEDHEAD_BACKENDS hides it" in msg, msg
    assert "not installed" not in msg and "pip install" not in msg, msg


def test_an_in_process_backend_hidden_by_the_limit_is_named_as_hidden(ref_backend, monkeypatch):
    """A registration that FUSEDHEAD_BACKENDS leaves out: named as hidden, exact or near."""
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "torch")
    said = {
        "ref-test": "Backend 'ref-test' is registered in-process, but FUSEDHEAD_BACKENDS hides it",
        "ref-tset": "Did you mean 'ref-test' (registered in-process, but FUSEDHEAD_BACKENDS hides",
    }
    for asked, want in said.items():
        with pytest.raises(UnknownBackendError) as info:
            registry.load_class(asked)
        assert want in str(info.value), str(info.value)


def test_an_unknown_name_lists_the_first_party_backends_as_they_install_before_pypi(
    with_fixture_dists,
):
    assert install_hints.ON_PYPI is False
    with pytest.raises(UnknownBackendError) as info:
        registry.load_class("my-backend")
    msg = str(info.value)
    assert "fusedhead[" not in msg, msg  # not on PyPI: an extra there installs nothing
    assert "triton (./plugins/triton_backend)" in msg and "fusedhead.backends" in msg, msg


def test_a_lookup_of_a_name_with_capitals_points_at_a_name_that_exists(with_fixture_dists):
    """'TORCH' is 'torch' lowercased; 'Good_' lowercased is no name, so the hint is the closest
    name that exists (never 'good_'); a name near none lists what there is. Registering a name
    with capitals is told its lowercase (a new name: nothing to point at)."""
    with pytest.raises(ValueError, match=r"did you mean 'torch'\?"):
        registry.find("TORCH")
    with pytest.raises(ValueError, match=r"did you mean 'good'\?") as info:
        registry.find("Good_")
    assert "good_" not in str(info.value)
    with pytest.raises(ValueError, match=r"names are lowercase; available: .*torch") as info:
        registry.find("Zzzzzz")
    with pytest.raises(ValueError, match=r"did you mean 'mine'\?"):
        registry.register_backend("Mine", type("B", (), {}))


def test_a_name_with_spaces_is_pointed_at_the_name_and_never_at_an_unselectable_one(
    with_fixture_dists, monkeypatch: pytest.MonkeyPatch
):
    """' torch' is told its stripped name; a misnamed entry point ('Bad-Upper', which no lookup
    can select) is never the did-you-mean of a name like it."""
    with pytest.raises(ValueError, match=r"names have no spaces: did you mean 'torch'\?"):
        registry.find(" torch")
    known = ["Bad-Upper", "bad-uppers", "torch"]
    with pytest.raises(ValueError, match=r"did you mean 'bad-uppers'\?"):
        registry._check_name("Bad-Upper", known)
    with pytest.raises(ValueError, match=r"names are lowercase; available: bad-uppers, torch\)$"):
        registry._check_name("Zzzz-Zz", known)


def test_a_first_party_name_in_capitals_that_is_not_installed_says_how_to_get_it() -> None:
    """'Triton' with only torch installed: its lowercase, and the command that installs it."""
    with pytest.raises(ValueError, match=r"names are lowercase: did you mean 'triton'\? It is not "
                       r"installed: pip install .*triton"):  # fmt: skip
        registry._check_name("Triton", ["torch"])


@pytest.mark.parametrize("value", ["", " ", ",", " , ,"])
def test_a_limit_naming_no_backend_limits_nothing(value: str, monkeypatch: pytest.MonkeyPatch):
    """FUSEDHEAD_BACKENDS=',' names no backend, as '' does: neither hides every backend."""
    monkeypatch.setenv(registry.LIMIT_ENV, value)
    assert registry._limit() is None
    monkeypatch.setenv(registry.LIMIT_ENV, " torch, ,liger")
    assert registry._limit() == {"torch", "liger"}
