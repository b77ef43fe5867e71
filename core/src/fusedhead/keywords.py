"""Unknown keyword arguments told apart: another trainer's name for one of ours, or a typo.

Python's own ``TypeError`` for ``fused_policy_loss(..., entropy_coeff=0.01)`` names the keyword
but not the parameter it stands for; a verl or TRL user passes their trainer's names first.
``known_keywords`` wraps an entry point so that such a call raises a ``TypeError`` that names
the keyword, what it is here, and the parameters there are. Calls with known keywords pay one
set comparison.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def known_keywords(foreign: Mapping[str, str]) -> Callable[[F], F]:
    """Wrap ``fn`` so that an unknown keyword gets ``foreign``'s explanation of it (keyed by
    the other trainer's name) or a did-you-mean among ``fn``'s keyword parameters."""

    def make(fn: F) -> F:
        params = inspect.signature(fn).parameters.values()
        names = frozenset(p.name for p in params if p.kind is not p.POSITIONAL_ONLY)
        own = sorted(p.name for p in params if p.kind is p.KEYWORD_ONLY)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not kwargs.keys() <= names:
                refuse(fn.__qualname__, sorted(kwargs.keys() - names), own, foreign)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return make


def refuse(where: str, unknown: list[str], own: list[str], foreign: Mapping[str, str]) -> None:
    """Raise the ``TypeError`` for ``unknown`` keywords of ``where``."""
    said = []
    for key in unknown:
        if key in foreign:
            said.append(f"{key!r} ({foreign[key]})")
            continue
        close = difflib.get_close_matches(key, own, n=1, cutoff=0.7)
        said.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    s = "s" if len(unknown) > 1 else ""
    raise TypeError(
        f"{where}() got unexpected keyword argument{s}: {'; '.join(said)}. "
        f"Its keyword arguments: {', '.join(own)}"
    )
