"""The messages a third-party backend's author meets when the entry point or the module is wrong.

Each distribution here is written by hand into a folder put on sys.path (``site_on_path``): a
dist-info with METADATA, entry_points.txt and, where a test says so, RECORD and top_level.txt,
next to the plugin's modules. From a review that wrote a plugin from the docs: a misspelt module
was called a broken install with advice to reinstall (E1), a misspelt class a failed import with
no did-you-mean (E2), an exception at import was shown without where it was raised (E3), and a
plugin API 1 backend was told to use a fusedhead that speaks 1, of which none was published (E5).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from fusedhead import cli, diagnostics, registry
from fusedhead.diagnostics import Status
from fusedhead.errors import BackendLoadError, IncompatibleBackendError, MissingDependencyError

#: A backend class by the plugin API, for modules that need one to exist.
BACKEND = """\
from fusedhead.protocol import Capabilities, NoOptions


class AcmeBackend:
    name = "{name}"
    Options = NoOptions
    plugin_api_version = 2

    def __init__(self, options): ...
    def capabilities(self, device): return Capabilities(devices=("cpu",))
    def check(self, device, dtype): ...
    def forward(self, call): ...


class AcmeOptions:
    pass
"""


def make_dist(
    site: Path,
    entry_points: dict[str, str],
    files: dict[str, str],
    *,
    record: bool = True,
    top_level: tuple[str, ...] = (),
    unlisted: tuple[str, ...] = (),
    name: str = "fh-author-acme",
) -> Path:
    """Write distribution ``name`` 0.1 into ``site``: ``files`` (path: text) beside a dist-info
    whose RECORD lists them (unless ``record`` is false) but not those of ``unlisted``."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fusedhead.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    )
    if top_level:
        (info / "top_level.txt").write_text("".join(f"{t}\n" for t in top_level))
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    if record:
        listed = [rel for rel in files if rel not in unlisted]
        listed += [f"{info.name}/{f.name}" for f in info.iterdir()] + [f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in listed))
    return site


@pytest.fixture
def site(tmp_path: Path, site_on_path: Callable[[Path], Path]) -> Callable[..., Path]:
    """``site(entry_points, files, **kw)``: :func:`make_dist` into a fresh folder on sys.path."""

    def put(*args: object, **kw: object) -> Path:
        folder = tmp_path / f"site{len(list(tmp_path.iterdir()))}"
        make_dist(folder, *args, **kw)  # type: ignore[arg-type]
        return site_on_path(folder)

    return put


def load_error(name: str = "acme") -> BackendLoadError:
    with pytest.raises(BackendLoadError) as info:
        registry.load_class(name)
    assert not isinstance(info.value, MissingDependencyError)
    assert (info.value.backend, info.value.distribution, info.value.version) == (
        name,
        "fh-author-acme",
        "0.1",
    )
    return info.value


ACME = {"fh_author_acme/__init__.py": BACKEND.format(name="acme")}


# --- E1: the entry point names a module the distribution does not have -----------------------


@pytest.mark.parametrize(
    "record", [True, False], ids=["files-from-RECORD", "top_level.txt-without-RECORD"]
)
def test_a_misspelt_module_in_the_entry_point_is_named_with_the_module_it_meant(site, record):
    """Before: "its own module 'fh_author_acm' ... is not installed, so the install of
    fh-author-acme is broken or stale. Fix: reinstall fh-author-acme", which never helps."""
    site({"acme": "fh_author_acm:AcmeBackend"}, ACME, record=record, top_level=("fh_author_acme",))
    err = load_error()
    assert err.reason == (
        "could not be imported: the entry point 'acme = fh_author_acm:AcmeBackend' of "
        "fh-author-acme names the module 'fh_author_acm', which does not exist in fh-author-acme "
        "(its top-level modules: fh_author_acme). Did you mean "
        "'acme = fh_author_acme:AcmeBackend'?"
    )
    assert "broken or stale" not in str(err)
    assert "reinstalling it as it is never fixes that" in (err.hint or "")
    assert 'acme = "fh_author_acme:AcmeBackend"' in (err.hint or "")
    assert "pip install" not in str(err)


def test_a_misspelt_submodule_is_matched_among_its_packages_modules(site):
    files = {**ACME, "fh_author_acme/backend.py": BACKEND.format(name="acme")}
    site({"acme": "fh_author_acme.backnd:AcmeBackend"}, files)
    err = load_error()
    assert "names the module 'fh_author_acme.backnd', which does not exist in fh-author-acme" in (
        err.reason
    )
    assert "(its modules in 'fh_author_acme': backend)" in err.reason
    assert err.reason.endswith("Did you mean 'acme = fh_author_acme.backend:AcmeBackend'?")


def test_a_module_its_files_list_but_that_is_gone_is_a_stale_install_to_reinstall(site):
    """Reinstalling helps only here: the distribution's RECORD lists the module."""
    folder = site(
        {"acme": "fh_author_acme.backend:AcmeBackend"}, {**ACME, "fh_author_acme/backend.py": ""}
    )
    (folder / "fh_author_acme" / "backend.py").unlink()
    err = load_error()
    assert "its own module 'fh_author_acme.backend' (of the entry point " in err.reason
    assert "is listed in the metadata of fh-author-acme but cannot be imported (" in err.reason
    assert "backend.py is gone), so the install of fh-author-acme is broken or stale" in err.reason
    assert err.hint == "reinstall fh-author-acme (uninstall it first if reinstalling does not help)"


def test_without_a_file_list_either_cause_is_named_with_both_fixes(site):
    site({"acme": "fh_author_acme.backnd:AcmeBackend"}, ACME, record=False)
    err = load_error()
    assert "either the entry point misspells it or its install is broken or stale" in err.reason
    assert "correct the entry point if it is wrong; if it is right, reinstall fh-author-acme" in (
        err.hint or ""
    )


def test_its_code_importing_a_module_its_distribution_lacks_names_the_import(site):
    """Not the entry point's module but one its code imports, which its files never held: no
    reinstall brings it; the import's line is named."""
    files = {
        "fh_author_acme/__init__.py": "import fh_author_acme.helpres\n",
        "fh_author_acme/helpers.py": "",
    }
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, files)
    err = load_error()
    assert "its code imports its own module 'fh_author_acme.helpres', which is not among the " in (
        err.reason
    )
    assert "did you mean 'fh_author_acme.helpers'?" in err.reason
    assert f"the import is at {folder / 'fh_author_acme' / '__init__.py'}, line 1" in err.reason
    assert "reinstalling it does not help" in (err.hint or "")


# --- E2: the entry point names an attribute the module does not have --------------------------


def test_a_misspelt_class_in_the_entry_point_is_named_with_the_class_it_meant(site):
    """Before: "entry point fh_author_acme:AcmeBakend failed to import: AttributeError: module
    'fh_author_acme' has no attribute 'AcmeBakend'. Fix: report this to the backend's authors"."""
    site({"acme": "fh_author_acme:AcmeBakend"}, ACME)
    err = load_error()
    assert err.reason == (
        "the entry point 'acme = fh_author_acme:AcmeBakend' of fh-author-acme names "
        "'AcmeBakend', which the module 'fh_author_acme' does not have. Did you mean "
        "'AcmeBackend'?"
    )
    assert 'acme = "fh_author_acme:AcmeBackend"' in (err.hint or "")
    assert "failed to import" not in str(err) and "report this" not in str(err)
    assert isinstance(err.__cause__, AttributeError)


def test_a_class_name_with_nothing_close_lists_the_classes_the_module_defines(site):
    site({"acme": "fh_author_acme:Implementation"}, ACME)
    err = load_error()
    assert err.reason.endswith(
        "names 'Implementation', which the module 'fh_author_acme' does not have (its public "
        "classes: AcmeBackend, AcmeOptions)"
    ), err.reason


def test_a_misspelt_nested_attribute_names_the_class_that_lacks_it(site):
    files = {"fh_author_acme/__init__.py": "class Outer:\n    class Inner:\n        pass\n"}
    site({"acme": "fh_author_acme:Outer.Iner"}, files)
    err = load_error()
    assert "names 'Iner', which the class 'fh_author_acme.Outer' does not have. Did you mean " in (
        err.reason
    )
    assert 'acme = "fh_author_acme:Outer.Inner"' in (err.hint or "")


def test_an_attribute_error_raised_by_the_modules_own_code_is_not_called_a_misspelling(site):
    files = {"fh_author_acme/__init__.py": "import os\n\nos.no_such_function_xyz()\n"}
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, files)
    err = load_error()
    assert "failed to import: AttributeError: module 'os' has no attribute" in err.reason
    assert f"(raised at {folder / 'fh_author_acme' / '__init__.py'}, line 3)" in err.reason
    assert "Did you mean" not in str(err)


# --- E3: an exception while the module is imported names where it was raised ------------------


RAISES = 'from fh_author_acme.helpers import boom\n\nX = 1\nboom("acme: boom at import")\n'
HELPERS = "import json\n\n\ndef boom(text):\n    json.loads('{')  # raises inside json\n"


def test_an_exception_at_import_names_the_plugins_innermost_line_and_stays_chained(site):
    """Before: "entry point ... failed to import: RuntimeError: ..." with no file or line. The
    innermost frame in the plugin's own files, not json's, where the exception came from."""
    files = {"fh_author_acme/__init__.py": RAISES, "fh_author_acme/helpers.py": HELPERS}
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, files)
    err = load_error()
    helpers = folder / "fh_author_acme" / "helpers.py"
    assert err.reason.startswith(
        "entry point fh_author_acme:AcmeBackend failed to import: JSONDecodeError: "
    ), err.reason
    assert err.reason.endswith(f"(raised at {helpers}, line 5, in boom)"), err.reason
    assert type(err.__cause__).__name__ == "JSONDecodeError"  # the Python API keeps the cause


def test_a_syntax_error_names_its_file_and_line(site):
    files = {"fh_author_acme/__init__.py": "X = 1\ndef broken(:\n"}
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, files)
    err = load_error()
    assert f"(raised at {folder / 'fh_author_acme' / '__init__.py'}, line 2)" in err.reason


def test_check_info_and_list_check_name_where_the_plugin_raised(site, capsys):
    files = {"fh_author_acme/__init__.py": 'X = 1\nraise RuntimeError("acme: boom at import")\n'}
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, files)
    at = f"(raised at {folder / 'fh_author_acme' / '__init__.py'}, line 2)"
    assert cli.main(["check", "acme", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "RuntimeError: acme: boom at import " + at in err, err
    assert cli.main(["info", "acme", "--device", "cpu", "--json"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "broken" and at in shown["error"]["reason"]
    listed = {r.name: r for r in diagnostics.listing(probe=True, device="cpu")}
    assert listed["acme"].status is Status.BROKEN and at in (listed["acme"].reason or "")


# --- E5: a backend for plugin API 1 -----------------------------------------------------------


def test_a_plugin_api_1_backend_is_never_sent_to_a_fusedhead_that_speaks_1():
    """Before: "... or use a fusedhead that speaks 1", of which none was ever published."""

    class Old:
        name = "old"
        plugin_api_version = 1

    with pytest.raises(IncompatibleBackendError) as info:
        registry.verify_backend_class(Old, backend="old")
    hint = info.value.hint or ""
    assert "use a fusedhead that speaks 1" not in hint
    assert "no published fusedhead speaks plugin API 1, so no other fusedhead helps" in hint
    assert "or port it to plugin API 2 (docs/writing-a-backend.md)" in hint
    assert hint.startswith("the backend is older than this fusedhead: upgrade its distribution")


def test_a_plugin_api_a_published_fusedhead_speaks_names_that_fusedhead(monkeypatch):
    """Once a later core drops version 2, its users are sent to the releases that speak it."""
    from fusedhead import protocol

    monkeypatch.setattr(protocol, "SUPPORTED_PLUGIN_API", (3, 3))

    class Two:
        name = "two"
        plugin_api_version = 2

    with pytest.raises(IncompatibleBackendError) as info:
        registry.verify_backend_class(Two, backend="two")
    assert "or use fusedhead 1.x, which speaks 2" in (info.value.hint or "")
