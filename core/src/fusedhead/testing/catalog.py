"""The ordered list of properties and how one is run into a ``Result``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fusedhead.testing.accuracy import ACCURACY
from fusedhead.testing.contract import CONTRACT
from fusedhead.testing.declared import DECLARED
from fusedhead.testing.distributed import DISTRIBUTED
from fusedhead.testing.outcome import NotRun, Outcome, PropertyFailure, Result
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
    """Property names matching ``pattern``: comma-separated substrings, any of which may match."""
    if not pattern:
        return list(PROPERTIES)
    parts = [p.strip() for p in pattern.split(",") if p.strip()]
    chosen = [name for name in PROPERTIES if any(p in name for p in parts)]
    if not chosen:
        raise ValueError(f"-k {pattern!r} matches no property; properties: {', '.join(PROPERTIES)}")
    return chosen


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run_property(name: str, target: Target) -> Result:
    """Run one property: pass, fail (the contract broken, or the backend crashed), or not run."""
    prop = PROPERTIES[name]
    start = time.perf_counter()
    try:
        prop(target)
    except NotRun as exc:
        return Result(name, Outcome.NOT_RUN, _one_line(str(exc)), time.perf_counter() - start)
    except PropertyFailure as exc:
        return Result(name, Outcome.FAIL, _one_line(str(exc)), time.perf_counter() - start)
    except Exception as exc:
        msg = f"the backend raised {type(exc).__name__}: {exc}"
        return Result(name, Outcome.FAIL, _one_line(msg), time.perf_counter() - start)
    return Result(name, Outcome.PASS, "", time.perf_counter() - start)


def check(
    backend: str,
    *,
    options: Mapping[str, Any] | str | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
    properties: Iterable[str] | None = None,
) -> list[Result]:
    """Run the kit (or the named properties) against ``backend``; raises if it cannot run here."""
    target = Target.resolve(backend, options, device, dtype)
    return [run_property(name, target) for name in (properties or PROPERTIES)]


def check_property(
    name: str,
    backend: str,
    options: Mapping[str, Any] | str | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
) -> Result:
    """One property as a pure function of (backend name, options, device, dtype)."""
    if name not in PROPERTIES:
        raise ValueError(f"unknown property {name!r}; properties: {', '.join(PROPERTIES)}")
    return run_property(name, Target.resolve(backend, options, device, dtype))
