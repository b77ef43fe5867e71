"""Helpers of the command-line tests: run ``fusedhead`` in-process and read its one error line."""

from __future__ import annotations

from collections.abc import Callable

#: ``fusedhead(*argv)``: the command's exit status, stdout and stderr.
Run = Callable[..., tuple[int, str, str]]


def error_line(err: str) -> str:
    """The stderr of a refused command: one line, ``fusedhead: error: ...``, no traceback."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusedhead: error: "), err
    return lines[0]


def traced_error_line(err: str) -> str:
    """The stderr of a refused command under ``FUSEDHEAD_TRACEBACK=1``: the traceback, then the
    same one error line as without it, on a line of its own."""
    assert err.startswith("Traceback (most recent call last):\n"), err
    assert err.endswith("\n"), err
    *traceback, last = err.splitlines()
    assert traceback and not any(ln.startswith("fusedhead: error: ") for ln in traceback), err
    assert last.startswith("fusedhead: error: "), err
    return last
