"""``fusedhead check`` and ``fusedhead list`` refuse a mistyped argument by name, ``--list`` too.

A ``-k`` pattern that matches nothing is a typo, never a filter silently dropped; ``check NAME
--list`` refuses a name or a device as a run refuses them, and prints JSON with ``--json``;
``list --device D`` without ``--check`` is refused, never ignored.
"""

from __future__ import annotations

import json

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


def test_check_list_json_is_a_json_list_of_the_properties_the_text_lists(fusedhead: Run) -> None:
    """Before: ``--list`` ignored ``--json`` and printed its ``name: description`` lines. Each
    object names its property by ``check --json``'s key, ``property``."""
    rc_text, text, _err = fusedhead("check", "torch", "--list", "-k", "forward,softcap")
    rc, out, err = fusedhead("check", "torch", "--list", "-k", "forward,softcap", "--json")
    rows = json.loads(out)
    assert rc == rc_text == 0 and err == ""
    assert isinstance(rows, list) and rows, out
    assert all(sorted(row) == ["description", "property"] for row in rows), rows
    assert [f"{row['property']}: {row['description']}" for row in rows] == text.splitlines()


def test_check_list_json_refuses_a_name_as_the_text_listing_does(fusedhead: Run) -> None:
    rc_text, _out, err_text = fusedhead("check", "torhc", "--list")
    rc, out, err = fusedhead("check", "torhc", "--list", "--json")
    assert rc == rc_text == 2 and error_line(err) == error_line(err_text)
    assert json.loads(out)["error"]["backend"] == "torhc"  # --json's error fields, no listing


@pytest.mark.parametrize("device", ["cpu", "cuda", "bogus", ""])
def test_list_device_without_check_is_a_usage_error(fusedhead: Run, device: str) -> None:
    """Before: plain ``list`` ignored ``--device`` (its help: "device for --check"), so the
    listing read as one made on that device."""
    rc, out, err = fusedhead("list", "--device", device)
    line = error_line(err)
    assert rc == 2 and out == ""
    assert line.startswith("fusedhead: error: list: argument --device: applies only with --check")
    assert f"got --device {device!r} without --check" in line, line
    assert line.endswith("(see fusedhead list --help)"), line


@pytest.mark.parametrize("device", ["bogus", "", "cuda:99"])
def test_list_check_still_refuses_a_device_it_cannot_use(fusedhead: Run, device: str) -> None:
    rc, out, err = fusedhead("list", "--check", "--device", device)
    line = error_line(err)
    assert rc == 2 and out == ""
    assert f"--device {device}" in line or f"got {device!r}" in line, line


@pytest.mark.parametrize("argv", [["check", "liger"], ["demo", "--backend", "liger"]])
def test_a_backends_python_options_advice_is_also_said_as_this_command_line_takes_it(
    fusedhead: Run, argv: list[str]
) -> None:
    """Liger on the CPU advises ``options={"implementation": "fallback"}`` (fusedhead's Python
    terms); ``check`` and ``demo`` take options as ``--options '<JSON>'``, and the line says so
    (the error line is the last: ``demo`` prints its progress on stderr before it)."""
    pytest.importorskip("fusedhead_liger", reason="the liger backend is not installed")
    code, _, err = fusedhead(*argv, "--device", "cpu")
    line = error_line(err.splitlines()[-1])
    assert code == 2
    assert 'options={"implementation": "fallback"}' in line
    assert line.endswith(
        """(on this command line, options={"implementation": "fallback"} is """
        """--options '{"implementation": "fallback"}')"""
    )
