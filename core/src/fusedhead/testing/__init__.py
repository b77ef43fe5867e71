"""The conformance kit: the fusedhead contract as properties any backend, a third party's too, runs.

Two ways to run it (needs ``pip install 'fusedhead[testing]'`` for the hypothesis cases)::

    fusedhead check NAME [--device cpu|cuda] [--dtype fp32|fp16|bf16] [--options JSON] [-k PATTERN]
    pytest -p fusedhead.testing.plugin --fusedhead-backend NAME --pyargs fusedhead.testing.suite

In Python, ``check(backend, ...)`` returns a ``Result`` per property and ``check_property(name,
backend, options, device, dtype)`` runs one. Importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fusedhead.testing.outcome import NotRun, Outcome, PropertyFailure, Result

if TYPE_CHECKING:
    from fusedhead.testing.catalog import PROPERTIES, check, check_property

_LAZY = {"PROPERTIES", "check", "check_property"}
__all__ = [
    "PROPERTIES",
    "NotRun",
    "Outcome",
    "PropertyFailure",
    "Result",
    "check",
    "check_property",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from fusedhead.testing import catalog

        return getattr(catalog, name)
    raise AttributeError(f"module 'fusedhead.testing' has no attribute {name!r}")
