"""The environment variables the ``fusedhead`` command reads take the usual spellings.

``FUSEDHEAD_TRACEBACK`` is on or off in any usual spelling and refuses anything else by name;
a ``FUSEDHEAD_BACKENDS`` name that differs from an installed one in case is pointed to it.
"""

from __future__ import annotations

from typing import Any

import pytest
from cli_helpers import Run, error_line

from fusedhead import cli


def _fail(args: Any) -> int:
    raise RuntimeError("kaputt")


@pytest.mark.parametrize(
    ("off", "on"),
    [("", "TRUE"), ("0", "yes"), ("false", "true"), ("No", "Yes"), ("OFF", "on"), ("off", " On ")],
)
def test_the_traceback_variable_takes_the_usual_on_and_off_spellings(
    monkeypatch: pytest.MonkeyPatch, fusedhead: Run, off: str, on: str
) -> None:
    monkeypatch.setattr(cli, "_cmd_list", _fail)
    monkeypatch.setenv(cli.TRACEBACK_ENV, off)
    rc, _out, err = fusedhead("list")
    assert rc == 1 and "RuntimeError: kaputt" in error_line(err)
    monkeypatch.setenv(cli.TRACEBACK_ENV, on)
    with pytest.raises(RuntimeError, match="kaputt"):
        cli.main(["list"])


@pytest.mark.parametrize("value", ["maybe", "2", "y e s"])
def test_the_traceback_variable_refuses_another_value_naming_it(
    monkeypatch: pytest.MonkeyPatch, fusedhead: Run, value: str
) -> None:
    monkeypatch.setenv(cli.TRACEBACK_ENV, value)
    rc, out, err = fusedhead("list")
    line = error_line(err)
    assert rc == 2 and f"{cli.TRACEBACK_ENV}={value!r} is not an on/off value" in line, line
    assert "true" in line and "off" in line and out == ""  # what it takes; nothing was listed


def test_a_backends_filter_name_in_the_wrong_case_is_pointed_to_the_installed_one(
    monkeypatch: pytest.MonkeyPatch, fusedhead: Run
) -> None:
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "TORCH")
    rc, out, _err = fusedhead("list")
    assert rc == 0 and "names 'TORCH', which nothing installs (did you mean 'torch'?)" in out, out
