"""The environment variables the ``fusedhead`` command reads take the usual spellings.

``FUSEDHEAD_TRACEBACK`` is on or off in any usual spelling and refuses anything else by name;
on, it adds the traceback before the error's one line and changes neither that line's meaning
nor the exit status; a ``FUSEDHEAD_BACKENDS`` name that differs from an installed one in case is
pointed to it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_helpers import Run, error_line, traced_error_line

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
    assert rc == 1 and "RuntimeError: kaputt" in error_line(err) and "Traceback" not in err
    monkeypatch.setenv(cli.TRACEBACK_ENV, on)
    rc, _out, err = fusedhead("list")
    assert rc == 1 and "RuntimeError: kaputt" in traced_error_line(err)


@pytest.mark.parametrize(
    ("argv", "status"),
    [
        (["check", "nope"], 2),  # bad input: an unknown backend
        (["check", "nope", "--json"], 2),
        (["info", "nope"], 2),
        (["bench", "--report-only", "--json", "/nonexistent/results.json"], 2),  # a missing file
    ],
)
def test_the_traceback_variable_keeps_bad_inputs_line_and_exit_status(
    monkeypatch: pytest.MonkeyPatch, fusedhead: Run, argv: list[str], status: int
) -> None:
    """Before: bad input under the variable raised out of ``main``: its traceback, no error line,
    and the interpreter's exit status 1 where the same input without it exits 2."""
    rc_plain, out_plain, err_plain = fusedhead(*argv)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    rc, out, err = fusedhead(*argv)
    assert rc == rc_plain == status
    assert traced_error_line(err) == error_line(err_plain)
    assert out == out_plain  # --json's error fields too, unchanged
    if argv[-1] == "--json":  # check's --json flag (bench's takes a path)
        assert json.loads(out)["error"]["backend"] == "nope"


def test_an_unexpected_failure_under_the_traceback_variable_points_to_it_not_to_the_variable(
    monkeypatch: pytest.MonkeyPatch, fusedhead: Run
) -> None:
    monkeypatch.setattr(cli, "_cmd_list", _fail)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    rc, _out, err = fusedhead("list")
    line = traced_error_line(err)
    assert rc == 1 and "(an unexpected failure; its traceback is above)" in line, line
    assert 'raise RuntimeError("kaputt")' in err  # the traceback shows where


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
