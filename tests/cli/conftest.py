"""The ``fusedhead`` fixture of the command-line tests: the command run in-process."""

from __future__ import annotations

import pytest
from cli_helpers import Run

from fusedhead import cli


@pytest.fixture
def fusedhead(capsys: pytest.CaptureFixture[str]) -> Run:
    """``fusedhead(*argv)``: the command's exit status, stdout and stderr."""

    def run(*argv: str) -> tuple[int, str, str]:
        rc = cli.main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run
