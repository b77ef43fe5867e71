"""Fixtures for the kit's own tests: the in-process kit backends and the example installed with pip."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "third_party_backend"
if str(HERE) not in sys.path:  # kit_backends by module name, here and in the kit's spawned ranks
    sys.path.insert(0, str(HERE))


@pytest.fixture
def kit_backends() -> Iterator[ModuleType]:
    """The kit test backends, registered in-process for one test."""
    import kit_backends

    kit_backends.register_all()
    yield kit_backends
    kit_backends.unregister_all()


@pytest.fixture(scope="session")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install examples/third_party_backend`` into a fresh target folder (the venv stays clean)."""
    target = tmp_path_factory.mktemp("example-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
    )
    return target


@pytest.fixture
def with_example(example_site: Path, site_on_path: Callable[[Path], Path]) -> Path:
    """The example distribution on sys.path (and PYTHONPATH for subprocesses) for one test."""
    return site_on_path(example_site)
