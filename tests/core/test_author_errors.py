"""The messages a third-party backend's author meets when the entry point or the module is wrong.

Each distribution here is written by hand into a folder put on sys.path (``site_on_path``): a
dist-info with METADATA, entry_points.txt and, where a test says so, RECORD and top_level.txt,
next to the plugin's modules. From a review that wrote a plugin from the docs: a misspelt module
was called a broken install with advice to reinstall (E1), a misspelt class a failed import with
no did-you-mean (E2), an exception at import was shown without where it was raised (E3), and a
plugin API 1 backend was told to use a fusedhead that speaks 1, of which none was published (E5).

Then a review of that change found four regressions against the core before it (R1-R4): a class
exported lazily (a module ``__getattr__`` importing it) whose import misses a declared dependency,
an AttributeError of the plugin's own code inside such a lazy import, a missing module that a
declared but uninstalled requirement provides (a namespace package, an entry point into a
dependency), and an egg-info's SOURCES.txt taken for a complete file list.
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
    requires: tuple[str, ...] = (),
) -> Path:
    """Write distribution ``name`` 0.1 into ``site``: ``files`` (path: text) beside a dist-info
    whose RECORD lists them (unless ``record`` is false) but not those of ``unlisted``, and whose
    METADATA has a Requires-Dist line for each of ``requires``."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
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


def test_a_newer_plugin_api_sends_to_a_newer_fusedhead_only_if_one_exists(monkeypatch):
    """Before: "upgrade fusedhead to one that speaks plugin API 3", though none may exist."""

    class Newer:
        name = "newer"
        plugin_api_version = 3

    with pytest.raises(IncompatibleBackendError) as info:
        registry.verify_backend_class(Newer, backend="newer")
    assert (info.value.hint or "").endswith(
        "upgrade fusedhead to one that speaks plugin API 3 if such a release exists (this "
        "fusedhead knows of none), else use a release of the backend for plugin API 2"
    ), info.value.hint
    monkeypatch.setitem(registry.PUBLISHED_PLUGIN_API, 3, "fusedhead 2.x")
    with pytest.raises(IncompatibleBackendError) as info:
        registry.verify_backend_class(Newer, backend="newer")
    assert "upgrade fusedhead to fusedhead 2.x, which speaks plugin API 3, or use a release " in (
        info.value.hint or ""
    )


# --- R1, R2: a class exported lazily (a module __getattr__ that imports it) -------------------


def lazy(backend: str, *, listed: bool = False) -> dict[str, str]:
    """A package exporting AcmeBackend lazily (PEP 562) from its ``backend`` module (``backend``:
    that module's text), ``__dir__`` naming it where ``listed``."""
    init = (
        "def __getattr__(name):\n"
        "    if name == 'AcmeBackend':\n"
        "        from fh_author_acme.backend import AcmeBackend\n"
        "        return AcmeBackend\n"
        "    raise AttributeError(name)\n"
    )
    if listed:
        init += "\n\ndef __dir__():\n    return ['AcmeBackend']\n"
    return {"fh_author_acme/__init__.py": init, "fh_author_acme/backend.py": backend}


def test_a_lazily_exported_class_missing_a_declared_dependency_names_its_pip_install(site):
    """R1. Before: "failed to load: getting 'AcmeBackend' ... raised ModuleNotFoundError ...
    report this to the backend's authors"; as the import step does, "pip install 'acme...>=1.0'"."""
    files = lazy("import fh_acme_kernels_xyz\n" + BACKEND.format(name="acme"))
    site({"acme": "fh_author_acme:AcmeBackend"}, files, requires=("fh-acme-kernels-xyz>=1.0",))
    with pytest.raises(MissingDependencyError) as info:
        registry.load_class("acme")
    err = info.value
    assert err.missing == "fh_acme_kernels_xyz"
    assert "the module 'fh_acme_kernels_xyz' is not installed (a dependency of fh-author-acme)" in (
        err.reason
    )
    assert (err.hint or "").startswith("pip install 'fh-acme-kernels-xyz>=1.0' (its Requires-Dist)")


@pytest.mark.parametrize("listed", [False, True], ids=["no-__dir__", "__dir__-names-it"])
def test_an_attribute_error_of_the_plugins_code_in_a_lazy_import_is_not_a_misspelling(site, listed):
    """R2. Before: "names 'AcmeBackend', which the module 'fh_author_acme' does not have. Did you
    mean 'AcmeBackend'?": the AttributeError was about os.path, raised by backend.py."""
    backend = "import os\n\nFAST = os.path.nonexistent_helper\n" + BACKEND.format(name="acme")
    folder = site({"acme": "fh_author_acme:AcmeBackend"}, lazy(backend, listed=listed))
    err = load_error()
    assert err.reason.startswith(
        "entry point fh_author_acme:AcmeBackend failed to load: getting 'AcmeBackend' from "
        "'fh_author_acme' raised AttributeError: module "
    ), err.reason
    assert "has no attribute 'nonexistent_helper'" in err.reason
    assert err.reason.endswith(f"(raised at {folder / 'fh_author_acme' / 'backend.py'}, line 3)")
    assert "Did you mean" not in str(err) and "entry point in the metadata" not in str(err)


@pytest.mark.parametrize("listed", [False, True], ids=["no-__dir__", "__dir__-names-it"])
def test_a_misspelt_class_behind_a_lazy_getattr_is_still_named_with_the_class_it_meant(
    site, listed
):
    """Its ``raise AttributeError(name)`` names no attribute or object: the name not among the
    module's names (``dir``) is what tells a misspelling."""
    files = lazy(BACKEND.format(name="acme"), listed=listed)
    site({"acme": "fh_author_acme:AcmeBakend"}, files)
    err = load_error()
    assert "names 'AcmeBakend', which the module 'fh_author_acme' does not have" in err.reason
    if listed:
        assert err.reason.endswith("Did you mean 'AcmeBackend'?"), err.reason


# --- R3: a missing module that a declared, uninstalled requirement may provide ----------------


def test_a_namespace_portion_from_an_uninstalled_requirement_leads_with_that_requirement(site):
    """R3. The plugin ships fh_ns_acme/fh_backend.py (a namespace package) and imports
    fh_ns_acme.kernels from its declared, uninstalled fh-ns-acme-kernels. Before: "its code
    imports its own module ... a module left out of the distribution, or a misspelt import ...
    reinstalling it does not help"."""
    files = {
        "fh_ns_acme/fh_backend.py": "import fh_ns_acme.kernels\n" + BACKEND.format(name="acme")
    }
    requires = ("fh-ns-acme-kernels>=1.0", "fh-only-for-docs; extra == 'docs'", "pydantic>=2")
    site({"acme": "fh_ns_acme.fh_backend:AcmeBackend"}, files, requires=requires)
    err = load_error()
    assert err.reason.startswith(
        "could not be imported: the module 'fh_ns_acme.kernels' is not installed, and "
        "fh-author-acme declares requirements that are not installed (fh-ns-acme-kernels>=1.0): "
        "it may come from one of them (a pip name need not be its import name). If it does not, "
        "its code imports its own module 'fh_ns_acme.kernels', which is not among the files of "
    ), err.reason
    assert (err.hint or "").startswith(
        "pip install 'fh-ns-acme-kernels>=1.0' (its Requires-Dist), or reinstall fh-author-acme "
        "with its dependencies; if 'fh_ns_acme.kernels' is still missing, the code or the "
        "packaging of fh-author-acme is wrong"
    ), err.hint
    assert "does not help" not in str(err)


def test_an_entry_point_into_a_dependency_of_another_pip_name_leads_with_that_requirement(site):
    """R3. ``acme = fh_acme_kernels.fh:AcmeBackend``, the module of its Requires-Dist
    fh-acme-kernels-cu12. Before: "names the module 'fh_acme_kernels.fh', whose package
    'fh_acme_kernels', which does not exist in ..." (no verb) and "reinstalling it as it is never
    fixes that"."""
    site(
        {"acme": "fh_acme_kernels.fh:AcmeBackend"},
        ACME,
        requires=("fh-acme-kernels-cu12>=1.0",),
    )
    err = load_error()
    assert err.reason == (
        "could not be imported: the module 'fh_acme_kernels' is not installed, and fh-author-acme "
        "declares requirements that are not installed (fh-acme-kernels-cu12>=1.0): it may come "
        "from one of them (a pip name need not be its import name). If it does not, the entry "
        "point 'acme = fh_acme_kernels.fh:AcmeBackend' of fh-author-acme names the module "
        "'fh_acme_kernels.fh', whose package 'fh_acme_kernels' does not exist in fh-author-acme "
        "(its top-level modules: fh_author_acme)."
    ), err.reason
    assert (err.hint or "").startswith(
        "pip install 'fh-acme-kernels-cu12>=1.0' (its Requires-Dist), or reinstall fh-author-acme "
        "with its dependencies; if 'fh_acme_kernels' is still missing, the entry point in the "
        "metadata of fh-author-acme is wrong: its authors correct it"
    ), err.hint
    assert "never fixes" not in str(err)


def test_a_module_of_its_own_regular_package_is_never_blamed_on_a_requirement(site):
    """No other distribution puts a module into a package with an ``__init__``: a misspelt import
    there is named as before, whatever its requirements."""
    files = {
        "fh_author_acme/__init__.py": "import fh_author_acme.helpres\n",
        "fh_author_acme/helpers.py": "",
    }
    site({"acme": "fh_author_acme:AcmeBackend"}, files, requires=("fh-acme-kernels-xyz>=1.0",))
    err = load_error()
    assert err.reason.startswith("could not be imported: its code imports its own module ")
    assert "fh-acme-kernels-xyz" not in str(err)


# --- R4: an egg-info's file list (SOURCES.txt, no RECORD) ------------------------------------


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        (
            "fh_author_acme.backend:AcmeBackend",
            "its code imports its own module 'fh_author_acme._ext', which cannot be imported",
        ),
        (
            "fh_author_acme.backnd:AcmeBackend",
            "(its modules in 'fh_author_acme': backend). Did you mean "
            "'acme = fh_author_acme.backend:AcmeBackend'?",
        ),
    ],
    ids=["its-extension-not-built", "a-misspelt-entry-point"],
)
def test_an_egg_info_source_list_is_read_as_incomplete_and_by_import_names(
    tmp_path, site_on_path, entry, said
):
    """R4. A ``setup.py develop`` install: the egg-info in src/ lists SOURCES.txt (the project's
    paths), no RECORD. Before: that list was taken as complete, its modules as ``src.*``, and an
    extension module not built yet was "not among the files ... reinstalling it does not help"."""
    src = tmp_path / "proj" / "src"
    (src / "fh_author_acme").mkdir(parents=True)
    (src / "fh_author_acme" / "__init__.py").write_text("")
    backend = "import fh_author_acme._ext\n" + BACKEND.format(name="acme")
    (src / "fh_author_acme" / "backend.py").write_text(backend)
    info = src / "fh_author_acme.egg-info"
    info.mkdir()
    (info / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: fh-author-acme\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fusedhead.backends]\nacme = {entry}\n")
    (info / "top_level.txt").write_text("fh_author_acme\n")
    (info / "SOURCES.txt").write_text(
        "setup.py\nsrc/fh_author_acme/__init__.py\nsrc/fh_author_acme/backend.py\n"
        "src/fh_author_acme/_ext.cpp\nsrc/fh_author_acme.egg-info/PKG-INFO\n"
    )
    site_on_path(src)
    err = load_error()
    assert said in err.reason, err.reason
    assert "broken or stale" in err.reason and "'src" not in err.reason
    assert "reinstalling it does not help" not in (err.hint or "")
    assert "never fixes" not in (err.hint or "")
    assert "reinstall fh-author-acme (uninstall it first if reinstalling does not help)" in (
        err.hint or ""
    )
