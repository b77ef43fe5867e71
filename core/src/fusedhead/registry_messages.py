"""What an unknown or unselectable backend name's error says: the names there are, a "did you
mean" among them, and the fix (a spelling, ``FUSEDHEAD_BACKENDS`` changed, or a pip install).

Text only: the registry passes in what this process can find (the names a lookup could select,
those ``FUSEDHEAD_BACKENDS`` hides, the claims on each name), so this module imports no registry.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from fusedhead import install_hints
from fusedhead.backend_names import ENTRY_POINT_GROUP, LIMIT_ENV, NAME_PATTERN, RESERVED_NAMES


class Claim(Protocol):
    """One claim on a name (the registry's ``Candidate``): here, only whose it is."""

    @property
    def distribution(self) -> str | None: ...


def check_name(
    name: object,
    known: Iterable[str] | None,
    hidden_names: Callable[[], Mapping[str, str]],
) -> None:
    """``name`` is a str that follows the entry points' naming rule. ``known``: the names a lookup
    could find, so that a misspelt one is pointed at one of them, not at its own lowercase;
    ``hidden_names``: the names ``FUSEDHEAD_BACKENDS`` hides, each with how it exists (asked only
    for a name the rule refuses)."""
    if not isinstance(name, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(name).__name__} {name!r}"
        )
    if not NAME_PATTERN.match(name):
        prefix, _, rest = name.partition(":")
        hint = ""
        if prefix == "fusedhead" and NAME_PATTERN.match(rest):
            hint = f" (the trainers' spelling {name!r} names fusedhead's backend {rest!r}: pass {rest!r})"
        elif NAME_PATTERN.match(low := name.strip().lower()):
            rule = "names are lowercase" if low != name.strip() else "names have no spaces"
            # only names that can be selected: an entry point misnamed 'Bad-Upper' is no answer
            names = None if known is None else sorted(n for n in known if NAME_PATTERN.match(n))
            hidden = hidden_names()
            if names is None or low in names:
                hint = f" ({rule}: did you mean {low!r}?)"
            elif close := difflib.get_close_matches(low, names, n=1, cutoff=0.6):
                hint = f" ({rule}: did you mean {close[0]!r}?)"
            elif low in hidden:  # there, but the variable leaves it out: no pip install helps
                hint = (
                    f" ({rule}: did you mean {low!r}? It is {hidden[low]}, but {LIMIT_ENV} "
                    f"hides it: add {low!r} there or unset it)"
                )
            elif low in install_hints.FIRST_PARTY_EXTRAS:  # a first-party name not installed
                command = install_hints.install_command(low)
                hint = f" ({rule}: did you mean {low!r}? It is not installed: {command})"
            else:
                hint = f" ({rule}; available: {', '.join(names) or 'none'})"
        raise ValueError(
            f"backend name {name!r} is not valid: expected lowercase [a-z0-9_-]+{hint}"
        )


def limit_strays(limit: set[str], available: Iterable[str], hidden: Mapping[str, str]) -> str:
    """`` {LIMIT_ENV} names 'TORCH', which nothing here provides (did you mean 'torch'?).`` for
    each name of the variable that selects nothing, so that a typo there is seen as the cause.
    ``hidden``: the names that exist here but the variable (``limit``) leaves out."""
    exists = set(available) | set(hidden)
    by_lower = {n.lower(): n for n in exists}
    notes = ""
    for stray in sorted(limit - exists):
        near = difflib.get_close_matches(stray.lower(), list(by_lower), n=1, cutoff=0.6)
        meant = f" (did you mean {by_lower[near[0]]!r}?)" if near else ""
        notes += f" {LIMIT_ENV} names {stray!r}, which nothing here provides{meant}."
    return notes


def unknown_name_message(
    name: str,
    available: Iterable[str],
    limit: set[str] | None,
    hidden: Mapping[str, str],
    claims: Callable[[], Mapping[str, Sequence[Claim]]],
) -> str:
    """Why ``name`` selects nothing: the selectable names of ``available`` (with a "Did you mean"
    among them), entry-point names that break the name rule apart, and how to install.

    ``limit``: the names ``FUSEDHEAD_BACKENDS`` limits discovery to (None: no limit); ``hidden``:
    the names that exist here but it leaves out, each with how it exists; ``claims``: every claim
    on each name (asked only where a name of ``available`` breaks the rule)."""
    everything = sorted(set(available))
    names = [n for n in everything if NAME_PATTERN.match(n)]
    unselectable = [n for n in everything if not NAME_PATTERN.match(n)]
    msg = f"unknown fusedhead backend {name!r}. "
    if limit is not None:  # what is listed is what the variable lets through, not all installed
        shown = ", ".join(names) if names else "none"
        msg += f"Available under {LIMIT_ENV}={os.environ[LIMIT_ENV]!r}: {shown}."
        msg += limit_strays(limit, everything, hidden)
    else:
        none = "No selectable backends are installed." if unselectable else None
        msg += f"Installed: {', '.join(names)}." if names else none or "No backends are installed."
    if unselectable:
        by_name = claims()
        shown = ", ".join(
            f"{n!r} ({', '.join(c.distribution or 'in-process' for c in by_name.get(n, ()))})"
            if by_name.get(n)
            else repr(n)
            for n in unselectable
        )
        msg += (
            f" Not selectable, as their names break the rule (lowercase [a-z0-9_-]+; "
            f"fusedhead list shows them): {shown}."
        )
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    near_hidden = difflib.get_close_matches(name, sorted(hidden.keys() - {name}), n=1, cutoff=0.6)
    absent = [  # first-party names neither selectable nor hidden: these need a pip install
        n
        for n in install_hints.FIRST_PARTY_EXTRAS
        if n != name and n not in hidden.keys() | set(names)
    ]
    if close:
        msg += f" Did you mean {close[0]!r}?"
    elif near_hidden:  # the fix is the variable, not a pip install
        near = near_hidden[0]
        msg += (
            f" Did you mean {near!r} ({hidden[near]}, but {LIMIT_ENV} hides it: add {near!r} "
            "there or unset it)?"
        )
    elif close := difflib.get_close_matches(name, absent, n=1, cutoff=0.6):
        msg += f" Did you mean {close[0]!r} (not installed: {install_hints.install_command(close[0])})?"
    if name in hidden:
        msg += f" Backend {name!r} is {hidden[name]}, but {LIMIT_ENV} hides it: add {name!r} there or unset it."
        return msg
    if name in install_hints.FIRST_PARTY_EXTRAS:
        msg += f" Backend {name!r} is provided by {RESERVED_NAMES[name]}: {install_hints.install_command(name)}."
    elif install_hints.ON_PYPI:
        extras = ", ".join(f"{n} ({e})" for n, e in install_hints.FIRST_PARTY_EXTRAS.items())
        msg += f" First-party backends: {extras}; third-party ones register the entry-point group {ENTRY_POINT_GROUP!r}."
    else:
        sources = ", ".join(f"{n} (./{s})" for n, s in install_hints.FIRST_PARTY_SOURCES.items())
        msg += (
            f" First-party backends, installed from a clone until fusedhead is on PyPI: {sources}; "
            f"third-party ones register the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    return msg
