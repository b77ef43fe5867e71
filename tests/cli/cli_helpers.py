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
