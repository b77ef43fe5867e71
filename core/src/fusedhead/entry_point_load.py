"""A backend's class from its entry point (``module:attr``), with errors that say what is wrong.

``EntryPoint.load`` in two steps, so that each failure is told apart: the module's import (a
missing module triaged by :func:`fusedhead.install_hints.import_error`, any other exception named
with where the plugin raised it) and the attribute (a misspelt name, offered the module's names
close to it). ``cand`` is the registry's ``Candidate`` (name, entry-point value, distribution);
``fields`` the identity its errors carry.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import inspect
from typing import Any

from fusedhead import install_hints
from fusedhead.errors import BackendLoadError, exception_text


def load_entry_point(cand: Any, ep: md.EntryPoint, fields: dict[str, Any]) -> Any:
    """What ``ep`` (``module:attr``) names, as ``EntryPoint.load`` gets it, in two steps so that
    each failure is told apart: the module's import (a missing module triaged by
    :func:`install_hints.import_error`; any other exception named with where the plugin raised
    it) and then the attribute (a misspelt name, with the module's names close to it).

    The attribute step may import too (a package exporting its class lazily, by a module
    ``__getattr__``): an ImportError there is triaged as at the import, and an AttributeError is a
    misspelt name only where it is about that name of that object (:func:`_lacks`); any other is
    the plugin's code failing, named with where it raised."""
    match = ep.pattern.match(ep.value)
    if match is None:
        raise BackendLoadError(
            f"the entry point {cand.name} = {cand.value!r} is not of the form module:attr",
            hint="name the backend class as package.module:Class in the entry point",
            **fields,
        )
    try:
        obj = importlib.import_module(match.group("module"))
    except ImportError as exc:
        raise install_hints.import_error(cand, exc, fields) from exc
    except (Exception, SystemExit) as exc:  # a plugin's sys.exit() at import is its bug too
        at = install_hints.raised_at(exc, cand)
        raise BackendLoadError(
            f"entry point {cand.value} failed to import: {exception_text(exc)}"
            + (f" (raised at {at})" if at else ""),
            hint="the backend's module raised this while it was imported: fix it there, or "
            "report this to the backend's authors",
            **fields,
        ) from exc
    module = match.group("module")
    parts = [p for p in (match.group("attr") or "").split(".") if p]
    for k, part in enumerate(parts):
        try:
            got = getattr(obj, part)
        except ImportError as exc:  # a lazy import in its module __getattr__
            raise install_hints.import_error(cand, exc, fields) from exc
        except (Exception, SystemExit) as exc:  # a module __getattr__ of its own that fails
            if isinstance(exc, AttributeError) and _lacks(obj, part, exc):
                raise _missing_attribute(cand, obj, module, parts, k, fields) from exc
            at = install_hints.raised_at(exc, cand)
            raise BackendLoadError(
                f"entry point {cand.value} failed to load: getting {part!r} from "
                f"{'.'.join([module, *parts[:k]])!r} raised {exception_text(exc)}"
                + (f" (raised at {at})" if at else ""),
                hint="the backend's code raised this while its class was got (a module "
                "__getattr__, or what it imports): fix it there, or report this to the backend's "
                "authors",
                **fields,
            ) from exc
        obj = got
    return obj


def _lacks(obj: Any, part: str, exc: AttributeError) -> bool:
    """Whether ``exc``, raised by ``getattr(obj, part)``, says that ``obj`` has no ``part``: an
    AttributeError about that name of that object (Python sets its ``name`` and ``obj``), or one
    naming nothing (``raise AttributeError(name)`` in a module ``__getattr__``), where ``part`` is
    not among ``obj``'s names either. One about another name or object is raised by the plugin's
    code (a lazily imported module touching ``torch.cuda.nonexistent_helper``)."""
    name, about = getattr(exc, "name", None), getattr(exc, "obj", None)
    if name is not None and (name != part or (about is not None and about is not obj)):
        return False
    try:
        return part not in dir(obj)
    except Exception:  # a __dir__ of its own that fails: only the exception tells
        return name == part and about is obj


def _missing_attribute(
    cand: Any, owner: Any, module: str, parts: list[str], k: int, fields: dict[str, Any]
) -> BackendLoadError:
    """The entry point's attribute path ``parts`` (after ``module:``) names ``parts[k]``, which
    ``owner`` (what ``parts[:k]`` reached) lacks: the public names of ``owner`` close to it
    (difflib, case aside), else the public classes it defines."""
    name = parts[k]
    where = ".".join([module, *parts[:k]])
    try:
        public = sorted(n for n in dir(owner) if not n.startswith("_"))
    except Exception:  # a __dir__ of its own that fails: no names to offer
        public = []
    lower = {n.lower(): n for n in public}
    close = [lower[n] for n in difflib.get_close_matches(name.lower(), list(lower), n=3)]
    what = "module" if inspect.ismodule(owner) else "class" if isinstance(owner, type) else "object"
    dist = cand.distribution or "the backend's distribution"
    if close:
        fixed = f"{module}:{'.'.join([*parts[:k], close[0], *parts[k + 1 :]])}"
        also = f" (or {', '.join(repr(c) for c in close[1:])})" if close[1:] else ""
        said = f". Did you mean {close[0]!r}{also}?"
        example = f', e.g. {cand.name} = "{fixed}"'
    else:
        classes = [n for n in public if isinstance(getattr(owner, n, None), type)]
        ours = [n for n in classes if getattr(getattr(owner, n), "__module__", None) == where]
        shown = ours or classes
        listed = ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")
        said = f" (its public classes: {listed})" if shown else " (it has no public class)"
        example = ""
    return BackendLoadError(
        f"the entry point '{cand.name} = {cand.value}' of {dist} names {name!r}, which the "
        f"{what} {where!r} does not have{said}",
        hint=f"the entry point in the metadata of {dist} is wrong: correct it (the table "
        f'[project.entry-points."fusedhead.backends"] of its pyproject.toml{example}) and '
        "reinstall it, as entry points are read from the installed metadata",
        **fields,
    )
