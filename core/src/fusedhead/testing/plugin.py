"""pytest plugin: run the conformance kit against a named backend, one test per property.

    pytest -p fusedhead.testing.plugin --fusedhead-backend NAME --pyargs fusedhead.testing.suite

Options: ``--fusedhead-device cpu|cuda|cuda:K``, ``--fusedhead-dtype fp32|fp16|bf16``,
``--fusedhead-options JSON``. A property that is not run here is skipped with the reason; a
backend that cannot run on the asked device/dtype makes every test error with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from fusedhead.cli import device_arg


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fusedhead", "fusedhead conformance kit")
    group.addoption(
        "--fusedhead-backend", default=None, help="backend name to check (required by the suite)"
    )
    group.addoption(
        "--fusedhead-device",
        default="cpu",
        type=device_arg,
        help="cpu (default), cuda or cuda:K, as `fusedhead check --device` takes",
    )
    group.addoption(
        "--fusedhead-dtype",
        default="fp32",
        choices=["fp32", "fp16", "bf16"],
        help="input dtype (default fp32)",
    )
    group.addoption("--fusedhead-options", default=None, help="backend options as a JSON object")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fusedhead_property(name): a property of the fusedhead conformance kit"
    )


@pytest.fixture(scope="session")
def fusedhead_target(request: pytest.FixtureRequest) -> Any:
    """The resolved backend under test (``fusedhead.testing.target.Target``)."""
    from fusedhead.errors import BackendError
    from fusedhead.testing.target import Target

    opt = request.config.getoption
    name = opt("--fusedhead-backend")
    if not name:
        pytest.fail("the fusedhead conformance suite needs --fusedhead-backend NAME", pytrace=False)
    try:
        return Target.resolve(
            name, opt("--fusedhead-options"), opt("--fusedhead-device"), opt("--fusedhead-dtype")
        )
    except (BackendError, ValueError) as exc:
        pytest.fail(f"backend {name!r} cannot be checked here: {exc}", pytrace=False)
