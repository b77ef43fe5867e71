"""The packaging test runs when asked for: ``pytest -m packaging tests/packaging`` (``.ci/run`` does) or FUSEDHEAD_PACKAGING=1."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "packaging: builds wheels and installs them into a fresh venv (network for PyPI, a few minutes)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = (
        "packaging" in (config.getoption("markexpr") or "")
        or os.environ.get("FUSEDHEAD_PACKAGING") == "1"
    )
    if asked:
        return
    skip = pytest.mark.skip(
        reason="packaging test (minutes, needs PyPI): run it with `pytest -m packaging tests/packaging` (.ci/run does)"
    )
    for item in items:
        if "packaging" in item.keywords:
            item.add_marker(skip)
