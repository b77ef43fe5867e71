"""The conformance kit as pytest tests: one test per property (see ``fusedhead.testing.plugin``)."""

from __future__ import annotations

from typing import Any

import pytest

from fusedhead.testing.catalog import PROPERTIES, run_property
from fusedhead.testing.outcome import Outcome


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_property(name: str, fusedhead_target: Any) -> None:
    result = run_property(name, fusedhead_target)
    if result.outcome is Outcome.NOT_RUN:
        pytest.skip(f"not run: {result.message}")
    if result.outcome is Outcome.FAIL:
        pytest.fail(f"{name}: {result.message}", pytrace=False)
