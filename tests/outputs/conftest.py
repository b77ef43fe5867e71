"""Fixtures for the output tests: the in-process output backends, registered for one test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture
def output_backends() -> Iterator[ModuleType]:
    """The correct and wrong output backends of ``output_backends.py``, registered in-process."""
    import output_backends

    output_backends.register_all()
    yield output_backends
    output_backends.unregister_all()
