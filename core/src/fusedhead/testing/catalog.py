"""The ordered list of properties and how one is run into a ``Result``."""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fusedhead.testing.accuracy import ACCURACY
from fusedhead.testing.contract import CONTRACT
from fusedhead.testing.declared import DECLARED
from fusedhead.testing.distributed import DISTRIBUTED
from fusedhead.testing.outcome import (
    NotRun,
    Outcome,
    PropertyFailure,
    Result,
    raised_by_backend,
)
from fusedhead.testing.outputs import OUTPUT_PROPERTIES
from fusedhead.testing.policy import POLICY_PROPERTIES
from fusedhead.testing.randomized import RANDOMIZED
from fusedhead.testing.target import Target

Property = Callable[[Target], None]

#: Every property of the kit, in the order it runs.
PROPERTIES: dict[str, Property] = {
    **ACCURACY,
    **CONTRACT,
    **DECLARED,
    **DISTRIBUTED,
    **RANDOMIZED,
    **OUTPUT_PROPERTIES,
    **POLICY_PROPERTIES,
}


def describe(name: str) -> str:
    """The property's one-line description (its docstring's first line)."""
    return (PROPERTIES[name].__doc__ or "").strip().splitlines()[0]


def select(pattern: str | None) -> list[str]:
    """Property names matching ``pattern``: comma-separated substrings, any of which may match
    (None: every property). An empty part, or one that matches no property, is refused by name:
    a typo would silently narrow the run."""
    if pattern is None:
        return list(PROPERTIES)
    parts = [part.strip() for part in pattern.split(",")]
    if "" in parts:
        raise ValueError(
            f"-k must be comma-separated parts of property names, none empty, got {pattern!r} "
            "(leave -k out to run every property)"
        )
    unmatched = [part for part in parts if not any(part in name for name in PROPERTIES)]
    if unmatched:
        words = sorted({w for name in PROPERTIES for w in (name, *name.split("_"))})
        named = ", ".join(f"{part!r}{_did_you_mean(part, words)}" for part in unmatched)
        raise ValueError(
            f"-k {named} {'matches' if len(unmatched) == 1 else 'match'} no property "
            f"(in {pattern!r}); properties: {', '.join(PROPERTIES)}"
        )
    return [name for name in PROPERTIES if any(part in name for part in parts)]


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _backend_verdict(target: Target, exc: BaseException) -> str | None:
    """The failure message when the backend raised the kit's own NotRun or PropertyFailure: a
    backend that could report itself not run (or fail with the kit's words) would dodge a property."""
    inner = raised_by_backend(exc)
    if inner is None:
        return None
    where = "" if inner is exc else f" [{exc}]"
    return (
        f"the backend {target.backend!r} raised the kit's own {type(inner).__name__}({inner}) "
        f"from a call the kit made{where}; a backend never raises fusedhead.testing's "
        "exceptions: only the kit decides what is not run"
    )


def run_property(name: str, target: Target) -> Result:
    """Run one property: pass, fail (the contract broken, or the backend crashed), or not run."""
    prop = PROPERTIES[name]
    start = time.perf_counter()
    try:
        prop(target)
    except Exception as exc:
        return Result(name, *_verdict(target, exc), time.perf_counter() - start)
    return Result(name, Outcome.PASS, "", time.perf_counter() - start)


def _verdict(target: Target, exc: Exception) -> tuple[Outcome, str]:
    """What an exception out of a property means: not run, a failure, or the backend crashing."""
    blamed = _backend_verdict(target, exc)
    if blamed is not None:
        return Outcome.FAIL, _one_line(blamed)
    if isinstance(exc, NotRun):
        return Outcome.NOT_RUN, _one_line(str(exc))
    if isinstance(exc, PropertyFailure):
        return Outcome.FAIL, _one_line(str(exc))
    return Outcome.FAIL, _one_line(f"the backend raised {type(exc).__name__}: {exc}")


def unknown_properties(names: Iterable[str]) -> None:
    """Raise ``ValueError`` naming each unknown property, the valid ones and the closest match."""
    for name in names:
        if name in PROPERTIES:
            continue
        close = difflib.get_close_matches(name, PROPERTIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown property {name!r}{hint} (properties: {', '.join(PROPERTIES)})")


def check(
    backend: str,
    *,
    options: Mapping[str, Any] | str | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
    properties: Iterable[str] | None = None,
) -> list[Result]:
    """Run the kit (or the named properties) against ``backend``; raises if it cannot run here,
    and ``ValueError`` (with a did-you-mean) for an unknown property name, before anything runs."""
    names = [properties] if isinstance(properties, str) else list(properties or PROPERTIES)
    unknown_properties(names)
    target = Target.resolve(backend, options, device, dtype)
    return [run_property(name, target) for name in names]


def check_property(
    name: str,
    backend: str,
    options: Mapping[str, Any] | str | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
) -> Result:
    """One property as a pure function of (backend name, options, device, dtype)."""
    unknown_properties([name])
    return run_property(name, Target.resolve(backend, options, device, dtype))
