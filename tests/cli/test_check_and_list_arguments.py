"""``fusedhead check`` and ``fusedhead list`` refuse a mistyped argument by name, ``--list`` too.

A ``-k`` pattern that matches nothing is a typo, never a filter silently dropped; ``check NAME
--list`` and ``list --device D`` refuse a name or a device as a run refuses them.
"""

from __future__ import annotations

import pytest
from cli_helpers import Run, error_line


@pytest.mark.parametrize("pattern", ["forward,determinsm", "determinsm,forward"])
def test_a_k_pattern_that_matches_nothing_is_refused_beside_one_that_matches(
    fusedhead: Run, pattern: str
) -> None:
    rc, out, err = fusedhead("check", "torch", "-k", pattern, "--list")
    line = error_line(err)
    assert rc == 2 and "argument -k: 'determinsm' (did you mean 'determinism'?)" in line, line
    assert "matches no property" in line and out == ""


def test_every_k_pattern_that_matches_nothing_is_named(fusedhead: Run) -> None:
    rc, _out, err = fusedhead("check", "torch", "-k", "forwrd,zzz,softcap", "--list")
    line = error_line(err)
    assert rc == 2 and "'forwrd' (did you mean 'forward'?), 'zzz' match no property" in line, line


@pytest.mark.parametrize("pattern", ["", ",", "forward,", " , forward"])
def test_an_empty_k_pattern_is_refused_not_read_as_every_property(
    fusedhead: Run, pattern: str
) -> None:
    rc, out, err = fusedhead("check", "torch", "-k", pattern, "--list")
    line = error_line(err)
    assert rc == 2 and "argument -k:" in line and "none empty" in line, line
    assert f"got {pattern!r}" in line and out == ""


@pytest.mark.parametrize("argv", [["check", "torhc"], ["check", "torch", "--device", "cuda:99"]])
def test_check_list_refuses_a_name_or_device_as_a_run_does(fusedhead: Run, argv: list[str]) -> None:
    """The run stops at the same argument before any property runs: the two lines are equal."""
    rc_run, _out, err_run = fusedhead(*argv, "-k", "forward_accuracy")
    rc, out, err = fusedhead(*argv, "--list")
    assert rc == rc_run == 2 and error_line(err) == error_line(err_run)
    assert out == ""


def test_check_list_refuses_options_it_would_not_read(fusedhead: Run) -> None:
    rc, out, err = fusedhead("check", "torch", "--list", "--options", '{"chunk_rows": 0}')
    line = error_line(err)
    assert rc == 2 and "argument --options: not allowed with --list" in line, line
    assert out == ""


@pytest.mark.parametrize("device", ["bogus", "", "cuda:99"])
def test_list_refuses_a_device_without_check_as_with_it(fusedhead: Run, device: str) -> None:
    rc_check, _out, err_check = fusedhead("list", "--check", "--device", device)
    rc, out, err = fusedhead("list", "--device", device)
    assert rc == rc_check == 2 and error_line(err) == error_line(err_check)
    assert f"--device {device}" in error_line(err) or f"got {device!r}" in error_line(err)
    assert out == ""
