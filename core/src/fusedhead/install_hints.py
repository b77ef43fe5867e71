"""What to install: the command for a first-party backend, true for how fusedhead is published,
and the triage of a backend's failed import (an entry point naming what its distribution does
not have, its own install broken, or which dependency is missing; where its code raised).

A leaf module: the registry's errors and ``fusedhead list`` name these commands.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import traceback
import urllib.parse
import urllib.request
from collections.abc import Iterable
from typing import Any, NamedTuple

from fusedhead.errors import BackendLoadError, MissingDependencyError

#: First-party backends and the extra that installs each.
FIRST_PARTY_EXTRAS = {
    "torch": "fusedhead[torch]",
    "triton": "fusedhead[triton]",
    "liger": "fusedhead[liger]",
}
#: Where each first-party backend's project lives in a clone of the repository.
FIRST_PARTY_SOURCES = {
    "torch": "plugins/torch_backend",
    "triton": "plugins/triton_backend",
    "liger": "plugins/liger_backend",
}
#: Whether the first-party distributions are published on PyPI. Until they are, a bare
#: ``pip install 'fusedhead[triton]'`` finds no fusedhead-triton, so :func:`install_command`
#: names what works from a clone instead; docs/releasing.md (step 6) sets it after the first upload.
ON_PYPI = False


def source_checkout() -> str | None:
    """The clone the core was installed from (``pip install [-e] ./core``), if it is still there.

    Read from the core's PEP 610 ``direct_url.json``; None for an install from wheels or an index.
    """
    try:
        text = md.distribution("fusedhead").read_text("direct_url.json")
        url = json.loads(text or "{}").get("url", "")
    except (md.PackageNotFoundError, ValueError, AttributeError, OSError):
        return None
    if not isinstance(url, str) or not url.startswith("file:"):
        return None
    core = urllib.request.url2pathname(urllib.parse.urlparse(url).path).rstrip("/")
    root = os.path.dirname(core)
    return root if os.path.isfile(os.path.join(root, "core", "pyproject.toml")) else None


def install_command(name: str) -> str:
    """The pip command that installs first-party backend ``name``, true for how it is published.

    ``pip install 'fusedhead[NAME]'`` once the distributions are on PyPI; until then the backend's
    folder in the clone the core came from, or a clone and the wheels ``scripts/build-dists`` makes.
    """
    extra = FIRST_PARTY_EXTRAS[name]
    if ON_PYPI:
        return f"pip install '{extra}'"
    source = FIRST_PARTY_SOURCES[name]
    root = source_checkout()
    if root is not None and os.path.isfile(os.path.join(root, source, "pyproject.toml")):
        return f"pip install '{os.path.join(root, source)}' (fusedhead is not on PyPI yet)"
    return (
        f"from a clone of the fusedhead repository (it is not on PyPI yet), pip install ./{source}, "
        f"or pip install --find-links dist '{extra}' with the wheels that scripts/build-dists "
        "built in dist/"
    )


def extra_command(extra: str) -> str:
    """The pip command that installs what the core's extra ``extra`` adds (``testing``, ``yaml``,
    ``bench``, ``transformers``): ``pip install 'fusedhead[EXTRA]'`` once fusedhead is on PyPI;
    until then the extra's own requirements, read from the core's metadata (a bare
    ``fusedhead[EXTRA]`` would look for fusedhead on the index)."""
    if ON_PYPI:
        return f"pip install 'fusedhead[{extra}]'"
    marker = re.compile(rf"""\s*;\s*extra\s*==\s*['"]{re.escape(extra)}['"]\s*$""")
    try:
        requires = md.distribution("fusedhead").requires or []
    except (md.PackageNotFoundError, ValueError, OSError):
        requires = []
    wanted = [marker.sub("", r) for r in requires if marker.search(r)]
    if not wanted:
        return f"pip install 'fusedhead[{extra}]'"
    return "pip install " + " ".join(f"'{r}'" for r in wanted)


def normalize(dist_name: str) -> str:
    """A distribution name normalized (PEP 503), for comparing names."""
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def import_error(cand: Any, exc: ImportError, fields: dict[str, Any]) -> Exception:
    """A missing module becomes ``MissingDependencyError`` (a third-party package) or
    ``BackendLoadError`` (the plugin's own module); a missing name, ``BackendLoadError``.

    The plugin's own missing module is looked up in its distribution's files (:func:`own_files`):
    a module the entry point names that the distribution does not have is a wrong entry point
    (reinstalling never fixes it: the message suggests close names), one its files list that does
    not import is a broken or stale install (reinstalling helps).

    Never ``pip install <import name>``: an import name is not a pip name (``yaml`` is PyYAML,
    ``cv2`` opencv-python) and the plugin's own package name on an index may be anyone's. A pip
    package is named only where the distribution's own Requires-Dist names it. ``cand``: the
    registry's ``Candidate``; ``fields``: the identity its errors carry.
    """
    dist = cand.distribution or "the backend's distribution"
    reinstall = _reinstall(cand)
    missing = getattr(exc, "name", None)
    top = missing.split(".")[0] if missing else None
    if isinstance(exc, ModuleNotFoundError) and missing and top:
        module = cand.entry_point.module if cand.entry_point is not None else ""
        # the entry point's own module, its package, or a sibling; not a distribution of that
        # name it requires (a module the entry point names may come from a dependency)
        if top == module.split(".")[0] and not _required_as(cand.distribution, top):
            return _own_module_missing(cand, exc, missing, fields)
        try:
            present = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            present = False
        if not present:
            required = _required_as(cand.distribution, top)
            if required:
                why = f"a dependency of {dist}"
                hint = (
                    f"pip install '{required}' (its Requires-Dist), or {reinstall} with its "
                    "dependencies"
                )
            else:  # declared under another pip name (yaml: PyYAML), or not declared at all
                why = (
                    f"{dist} imports it; its Requires-Dist names no distribution {top!r}: a "
                    "dependency under another name, or one it does not declare"
                )
                hint = (
                    f"{reinstall} with its dependencies; if {top!r} is still missing, install "
                    f"the package that provides it (its pip name may differ) and report the "
                    f"missing requirement to the authors of {dist}"
                )
            return MissingDependencyError(
                f"could not be imported: the module {top!r} is not installed ({why}) ({exc})",
                missing=top,
                hint=hint,
                **fields,
            )
    own = (cand.entry_point.module if cand.entry_point is not None else "").split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) and top and top == own:
        # a name its own package lacks: its own code or its install, nothing else installed
        at = raised_at(exc, cand)
        return BackendLoadError(
            f"could not be imported: {exc} (a name its own package {top!r} lacks: the install "
            f"of {dist} is broken or stale, or its code is wrong"
            + (f"; the import is at {at})" if at else ")"),
            hint=f"{reinstall}; if the error stays, report it to the authors of {dist}",
            **fields,
        )
    if not isinstance(exc, ModuleNotFoundError) and top and top not in ("fusedhead", own):
        required = _required_as(cand.distribution, top)
        return BackendLoadError(
            f"could not be imported: {exc} (the installed {top!r} lacks a name {dist} uses: "
            "not the version it was built for)",
            hint=f"pip install '{required}' (its Requires-Dist)"
            if required
            else f"install the version of {top!r} that {dist} needs, or {reinstall} with its "
            "dependencies",
            **fields,
        )
    return BackendLoadError(
        f"could not be imported: {type(exc).__name__}: {exc}",
        hint=f"the installed packages do not match what {cand.distribution or 'the backend'} was "
        f"built for; upgrade fusedhead and the backend together, or {reinstall}",
        **fields,
    )


def _reinstall(cand: Any) -> str:
    """How to reinstall ``cand``'s distribution: a first-party backend's command, else words."""
    if cand.name in FIRST_PARTY_EXTRAS:
        return install_command(cand.name)
    dist = cand.distribution or "the backend's distribution"
    return f"reinstall {dist}"


def _own_module_missing(
    cand: Any, exc: ModuleNotFoundError, missing: str, fields: dict[str, Any]
) -> BackendLoadError:
    """The plugin's own module ``missing`` did not import: a module its entry point names that its
    distribution does not have (the entry point is wrong: no reinstall fixes it), one its files
    list (its install is broken or stale), or one its code imports that it does not have.

    Where its distribution does not have ``missing`` (or does not tell) and declares requirements
    that are not installed, the message leads with those (a namespace package's portion, or an
    import name whose pip name differs, may come from one of them), then the other causes."""
    dist = cand.distribution or "the backend's distribution"
    target = cand.entry_point.module
    entry = f"{cand.name} = {cand.value}"
    own = own_files(cand)
    has = own.has(missing)
    if has:
        return BackendLoadError(
            f"could not be imported: its own module {missing!r} (of the entry point "
            f"{cand.value}) is listed in the metadata of {dist} but cannot be imported"
            f"{own.gone(missing)}, so the install of {dist} is broken or stale ({exc})",
            hint=f"{_reinstall(cand)} (uninstall it first if reinstalling does not help)",
            **fields,
        )
    near, inventory = own.near(missing)
    # what: the cause its distribution's files tell; fix: its fix; then: its fix once the
    # requirements are installed (the hint names those first)
    if target != missing and not target.startswith(missing + "."):
        # a module its own code imports, not one the entry point names
        at = raised_at(exc, cand)
        where = f"; the import is at {at}" if at else ""
        if has is False:
            meant = f"; did you mean {near!r}?" if near else ""
            what = (
                f"its code imports its own module {missing!r}, which is not among the files of "
                f"{dist} ({inventory}{meant}): a module left out of the distribution, or a "
                f"misspelt import{where}"
            )
            then = f"the code or the packaging of {dist} is wrong: report this to its authors"
            fix = (
                f"the code or the packaging of {dist} is wrong, so reinstalling it does not "
                "help: report this to its authors"
            )
        else:  # its files are not known (an egg-info, an editable install): either may be it
            what = (
                f"its code imports its own module {missing!r}, which cannot be imported ({exc}); "
                f"{dist} lists no files that tell whether it has it, so either its install is "
                "broken or stale (a module not built or not installed), or the import names a "
                f"module it does not have (misspelt, or left out of the distribution){where}"
            )
            then = (
                f"{_reinstall(cand)}; if the error stays, the code or the packaging of {dist} is "
                "wrong: report this to its authors"
            )
            fix = (
                f"{_reinstall(cand)} (uninstall it first if reinstalling does not help); if the "
                f"error stays, the code or the packaging of {dist} is wrong: report this to its "
                "authors"
            )
    else:
        names = (
            f"names the module {target!r}"
            if missing == target
            else f"names the module {target!r}, whose package {missing!r}"
        )
        fixed = None
        if near is not None:  # the close name, and the rest of the entry point's module after it
            pieces = near.split(".")
            fixed = ".".join([*pieces, *target.split(".")[len(pieces) :]])
            if own.complete and fixed not in own.modules:
                fixed = None  # a part after it is not there either: no sure suggestion
        attr = cand.entry_point.attr
        value = f"{fixed}:{attr}" if fixed and attr else fixed
        meant = f" Did you mean '{cand.name} = {value}'?" if value else ""
        if has is False:  # the entry point names what its distribution does not have
            example = f', e.g. {cand.name} = "{value}"' if value else ""
            what = (
                f"the entry point {entry!r} of {dist} {names}"
                + (", which" if missing == target else "")
                + f" does not exist in {dist} ({inventory}).{meant}"
            )
            correct = (
                'its authors correct it (the table [project.entry-points."fusedhead.backends"] '
                f"of its pyproject.toml{example}) and reinstall it"
            )
            then = f"the entry point in the metadata of {dist} is wrong: {correct}"
            fix = (
                f"the entry point in the metadata of {dist} is wrong, and reinstalling it as it "
                f"is never fixes that: {correct}"
            )
        else:  # its files are not known (no RECORD, or an editable install): either may be it
            what = (
                f"the entry point {entry!r} of {dist} {names}"
                + (", which" if missing == target else "")
                + f" cannot be imported ({exc}); {dist} lists no files that tell whether it "
                "has it, so either the entry point misspells it or its install is broken or "
                f"stale ({inventory}).{meant}"
            )
            then = f"correct the entry point if it is wrong; if it is right, {_reinstall(cand)}"
            fix = then + " (uninstall it first if reinstalling does not help)"
    unmet = [] if own.in_package(missing) else unmet_requirements(cand)
    if not unmet:
        return BackendLoadError(f"could not be imported: {what}", hint=fix, **fields)
    listed = ", ".join(unmet)
    return BackendLoadError(
        f"could not be imported: the module {missing!r} is not installed, and {dist} declares "
        f"requirements that are not installed ({listed}): it may come from one of them (a pip "
        f"name need not be its import name). If it does not, {what}",
        hint="pip install "
        + " ".join(f"'{r}'" for r in unmet)
        + f" (its Requires-Dist), or {_reinstall(cand)} with its dependencies; if {missing!r} is "
        f"still missing, {then}",
        **fields,
    )


def unmet_requirements(cand: Any) -> list[str]:
    """The requirements (name and version, no marker or extras) in the Requires-Dist of ``cand``'s
    distribution that apply here and whose distribution is not installed, in its order. A
    requirement of an extra, or whose marker cannot be evaluated, is left out."""
    dist = _distribution(cand)
    try:
        requires = (dist.requires if dist is not None else None) or []
    except (OSError, ValueError):
        return []
    unmet = []
    for req in requires:
        spec, _, marker = req.partition(";")
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip())
        if name is None or (marker.strip() and not _marker_applies(marker.strip())):
            continue
        try:
            md.distribution(name.group(0))
        except md.PackageNotFoundError:
            unmet.append(re.sub(r"\[.*?\]", "", spec.strip()))
        except (ValueError, OSError):
            continue
    return unmet


def _marker_applies(marker: str) -> bool:
    """Whether a Requires-Dist environment marker holds here (with no extra asked for); False where
    it cannot be evaluated (``packaging`` not installed, a marker it cannot read)."""
    if re.search(r"\bextra\b", marker):
        return False  # installed only with an extra: not a requirement that must be there
    try:
        from packaging.markers import Marker

        return bool(Marker(marker).evaluate())
    except Exception:  # packaging missing, or a marker it rejects: not known to apply
        return False


class OwnFiles(NamedTuple):
    """What a backend's distribution installs, read from its metadata (nothing is imported)."""

    #: Dotted names of the modules and packages its files hold (RECORD, ``dist.files``).
    modules: frozenset[str]
    #: Its top-level import names: those of ``modules`` and its ``top_level.txt``.
    tops: frozenset[str]
    #: Whether ``modules`` is every module it installs (a RECORD, no ``.pth`` of an editable
    #: install pointing elsewhere).
    complete: bool
    #: Each module's file, where a RECORD names one (``module -> PackagePath``).
    paths: dict[str, Any]
    #: The regular packages among ``modules`` (an ``__init__`` file listed): no other
    #: distribution puts a module in one.
    packages: frozenset[str] = frozenset()

    def has(self, module: str) -> bool | None:
        """Whether the distribution has ``module``; None where its metadata does not tell."""
        if self.complete:
            return module in self.modules
        top = module.split(".")[0]
        if module in self.modules or (module == top and top in self.tops):
            return True
        if self.tops and top not in self.tops:
            return False
        return None

    def gone(self, module: str) -> str:
        """`` (FILE is gone)`` where ``module``'s listed file is not on disk, else ``""``."""
        path = self.paths.get(module)
        try:
            where = path.locate() if path is not None else None
        except (OSError, ValueError, NotImplementedError):
            return ""
        return f" ({where} is gone)" if where is not None and not os.path.exists(where) else ""

    def in_package(self, module: str) -> bool:
        """Whether ``module`` would be in a regular package of the distribution (so no dependency
        can provide it, as one may provide a portion of a namespace package)."""
        parent = module.rpartition(".")[0]
        return bool(parent) and parent in self.packages

    def near(self, module: str) -> tuple[str | None, str]:
        """(the module path ``module`` probably meant, up to its first part the distribution lacks,
        or None; what the distribution has at that level, for the message)."""
        parts = module.split(".")
        known = self.modules | self.tops
        i = next((k for k in range(len(parts)) if ".".join(parts[: k + 1]) not in known), None)
        if i is None:
            return None, ""
        level = sorted(
            {n.split(".")[i] for n in known if n.split(".")[:i] == parts[:i] and n.count(".") >= i}
        )
        lower = {n.lower(): n for n in level}
        close = difflib.get_close_matches(parts[i].lower(), list(lower), n=1, cutoff=0.6)
        near = ".".join([*parts[:i], lower[close[0]]]) if close else None
        where = "top-level modules" if i == 0 else f"modules in {'.'.join(parts[:i])!r}"
        if not level:
            return near, f"it lists no {where}"
        shown = ", ".join(level[:8]) + (", ..." if len(level) > 8 else "")
        return near, f"its {where}: {shown}"


def _distribution(cand: Any) -> md.Distribution | None:
    """The distribution ``cand``'s entry point comes from (that copy, where it is known)."""
    dist = getattr(cand.entry_point, "dist", None)
    if dist is not None or cand.distribution is None:
        return dist
    try:
        return md.distribution(cand.distribution)
    except (md.PackageNotFoundError, ValueError, OSError):
        return None


def own_files(cand: Any) -> OwnFiles:
    """The modules ``cand``'s distribution installs, from its file list and ``top_level.txt``.

    Only a RECORD is a complete list, relative to where the modules are installed. Without one,
    ``dist.files`` falls back to an egg-info's ``installed-files.txt`` or ``SOURCES.txt`` (the
    project's own paths: ``setup.py``, ``src/pkg/...``, for a ``setup.py develop`` install): its
    modules are read from their ``top_level.txt`` name on (``src/pkg/mod.py`` is ``pkg.mod``),
    none without one, and the list is never complete."""
    modules: set[str] = set()
    packages: set[str] = set()
    paths: dict[str, Any] = {}
    tops: set[str] = set()
    complete = False
    dist = _distribution(cand)
    if dist is not None:
        try:
            listed = dist.read_text("top_level.txt") or ""
        except (OSError, ValueError):
            listed = ""
        tops.update(line.strip() for line in listed.splitlines() if line.strip().isidentifier())
        try:
            files = dist.files
            record = dist.read_text("RECORD") is not None
        except (OSError, ValueError):
            files, record = None, False
        complete = bool(files) and record
        for path in files or ():
            parts = path.parts
            if len(parts) == 1 and path.suffix == ".pth":  # an editable install: code elsewhere
                complete = False
            if not record:  # project paths: from the first top-level name on, else nothing
                at = next((k for k, part in enumerate(parts[:-1]) if part in tops), None)
                top = parts[-1].partition(".")[0]
                if at is None and top in tops:
                    at = len(parts) - 1  # a top-level module (mod.py, src/mod.py)
                parts = parts[at:] if at is not None else ()
                if not parts:
                    continue
            name = _module_of(parts)
            if name is None:
                continue
            if name.split(".")[-1].startswith("__editable__"):  # setuptools' editable finder
                complete = False
                continue
            if record:
                paths.setdefault(name, path)
            if parts[-1].startswith("__init__."):
                packages.add(name)
            pieces = name.split(".")
            modules.update(".".join(pieces[: k + 1]) for k in range(len(pieces)))
    tops.update(n.split(".")[0] for n in modules)
    return OwnFiles(frozenset(modules), frozenset(tops), complete, paths, frozenset(packages))


def _module_of(parts: Iterable[str]) -> str | None:
    """The dotted module a file of a distribution (its path's parts) holds, or None."""
    *folders, file = parts
    stem, dot, suffix = file.partition(".")
    suffix = suffix.rsplit(".", 1)[-1] if dot else ""
    if suffix not in ("py", "pyc", "so", "pyd") or "__pycache__" in folders:
        return None
    names = folders if stem == "__init__" else [*folders, stem]
    if not names or not all(n.isidentifier() for n in names):
        return None  # a script, a data file's folder, ../bin, a dist-info
    return ".".join(names)


#: The core's own folder: a frame there is never where a plugin raised.
_CORE = os.path.dirname(os.path.realpath(__file__))


def raised_at(exc: BaseException, cand: Any) -> str | None:
    """``FILE, line N`` (``, in FUNC`` inside a function) where ``exc`` was raised: the innermost
    frame of its traceback in the plugin's own files (its distribution's files, the top-level
    packages of those and of its entry point), else the innermost outside importlib and fusedhead;
    a SyntaxError's own file and line. None where nothing is known."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f"{exc.filename}, line {exc.lineno}"
    frames = [
        (frame.f_code.co_filename, line, frame.f_code.co_name)
        for frame, line in traceback.walk_tb(exc.__traceback__)
    ]
    roots = _own_roots(cand)

    def inside(file: str, folders: Iterable[str]) -> bool:
        real = os.path.realpath(file)
        return any(real == r or real.startswith(r + os.sep) for r in folders)

    chosen = next((f for f in reversed(frames) if inside(f[0], roots)), None)
    if chosen is None:
        chosen = next(
            (f for f in reversed(frames) if not f[0].startswith("<") and not inside(f[0], [_CORE])),
            None,
        )
    if chosen is None:
        return None
    file, line, function = chosen
    return f"{file}, line {line}" + ("" if function == "<module>" else f", in {function}")


def _own_roots(cand: Any) -> list[str]:
    """The plugin's own files and folders: its distribution's files, and where the top-level
    packages of those and of its entry point's module are (nothing is imported)."""
    roots: set[str] = set()
    own = own_files(cand)
    for path in own.paths.values():
        try:
            roots.add(os.path.realpath(str(path.locate())))
        except (OSError, ValueError, NotImplementedError):
            continue
    tops = set(own.tops)
    if cand.entry_point is not None:
        tops.add(cand.entry_point.module.split(".")[0])
    for top in sorted(tops - {"fusedhead"}):
        try:
            spec = importlib.util.find_spec(top)
        except Exception:  # a finder of its own that fails: that top is not known
            continue
        if spec is None:
            continue
        folders = list(spec.submodule_search_locations or ())
        if folders:
            roots.update(os.path.realpath(f) for f in folders)
        elif spec.origin and os.path.isfile(spec.origin):
            roots.add(os.path.realpath(spec.origin))
    return sorted(roots)


def _required_as(distribution: str | None, module: str) -> str | None:
    """The requirement (name and version, no marker) in ``distribution``'s Requires-Dist whose
    name is import name ``module`` (normalized), or None: only then is the pip name known."""
    if distribution is None:
        return None
    try:
        requires = md.distribution(distribution).requires or []
    except (md.PackageNotFoundError, ValueError, OSError):
        return None
    for req in requires:
        spec = req.split(";", 1)[0].strip()
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
        if name and normalize(name.group(0)) == normalize(module):
            return re.sub(r"\[.*?\]", "", spec)
    return None
