"""``fusedhead bench`` refuses, before any work and by name, a run that could not go as asked.

An implementation with no case to run, a grid value given twice, measurement arguments that
``--report-only`` would ignore, an output file that cannot be created (its own reason), and
JSON values named by JSON's type names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import Run, error_line

TINY = ["--n", "8", "--hidden", "8", "--vocab", "16", "--no-memory", "--reps", "1"]


@pytest.mark.parametrize("cases", [[], ["--case", "logprobs", "topk2"]])
def test_unfused_without_the_policy_case_is_refused_before_any_work(
    fusedhead: Run, tmp_path: Path, cases: list[str]
) -> None:
    out_json = tmp_path / "r.json"
    argv = ["bench", *TINY, "--impl", "torch", "unfused:torch", *cases, "--json", str(out_json)]
    rc, out, err = fusedhead(*argv)
    line = error_line(err)
    assert rc == 2 and "--impl unfused:torch runs the policy case only" in line, line
    assert "add --case policy" in line and not out_json.exists() and "running" not in out


@pytest.mark.parametrize(
    ("flag", "values", "twice"),
    [
        ("--case", ["logprobs", "lse", "logprobs"], "logprobs"),
        ("--n", ["8", "16", "8"], "8"),
        ("--hidden", ["8", "8"], "8"),
        ("--vocab", ["16", "16"], "16"),
        ("--dtype", ["fp32", "fp32"], "fp32"),
        ("--scale", ["1", "1.0"], "1.0"),
    ],
)
def test_a_grid_value_given_twice_is_refused_before_any_work(
    fusedhead: Run, tmp_path: Path, flag: str, values: list[str], twice: str
) -> None:
    out_json = tmp_path / "r.json"
    rc, _out, err = fusedhead(
        "bench", *TINY, "--impl", "torch", flag, *values, "--json", str(out_json)
    )
    line = error_line(err)
    assert rc == 2 and line.startswith(f"fusedhead: error: {flag} "), line
    assert f"{twice} given twice" in line and not out_json.exists()


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--n", "8", "--impl", "torch"], "--n, --impl"),
        (["--temperature", "1"], "--temperature"),
        (["--max-minutes", "1", "--no-accuracy"], "--max-minutes, --no-accuracy"),
        (["--append"], "--append"),
        (["--device", "cpu"], "--device"),
    ],
)
def test_report_only_refuses_the_measurement_arguments_it_would_ignore(
    fusedhead: Run, tmp_path: Path, given: list[str], named: str
) -> None:
    results = tmp_path / "r.json"
    results.write_text("[]")
    rc, out, err = fusedhead("bench", "--report-only", "--json", str(results), *given)
    line = error_line(err)
    assert rc == 2 and f"--report-only measures nothing, so {named} would be ignored" in line, line
    assert out == ""


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_whose_folder_cannot_be_made_names_that_folder(fusedhead: Run) -> None:
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", "--json", "/proc/nope/r.json")
    line = error_line(err)
    assert rc == 2 and "--json /proc/nope/r.json: the folder /proc/nope cannot be created" in line
    assert "not writable" not in line, line


@pytest.mark.parametrize(
    ("text", "named"),
    [("null", "null"), ("[1]", "array"), ('"x"', "string"), ("1.5", "number"), ("true", "boolean")],
)
@pytest.mark.parametrize("command", ["check", "demo"])
def test_options_that_are_not_an_object_are_named_by_json_type(
    fusedhead: Run, command: str, text: str, named: str
) -> None:
    rc, _out, err = fusedhead(
        command, *(["torch"] if command == "check" else []), "--options", text
    )
    line = error_line(err)
    assert rc == 2 and "argument --options: must be a JSON object" in line
    assert f"got a JSON {named}: {text!r}" in line, line


@pytest.mark.parametrize(
    ("content", "why"),
    [("{}", "holds a JSON object, not the list"), ("[null]", "(a JSON null, not an object)")],
)
def test_results_that_are_not_a_list_of_objects_are_named_by_json_type(
    fusedhead: Run, tmp_path: Path, content: str, why: str
) -> None:
    results = tmp_path / "r.json"
    results.write_text(content)
    rc, _out, err = fusedhead("bench", "--report-only", "--json", str(results))
    line = error_line(err)
    assert rc == 2 and why in line, line


def test_impl_options_that_are_not_an_object_are_named_by_json_type(fusedhead: Run) -> None:
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch:null")
    line = error_line(err)
    assert rc == 2 and "options after ':' must be a JSON object, got a JSON null" in line, line


SIZES = ["--n", "8192", "--hidden", "1024", "--vocab", "32000", "--device", "cpu"]
TOO_LARGE = (
    "--n 8192 --hidden 1024 --vocab 32000 (fp32): the hidden states, the weight and one [N, V] "
    "GEMM of logits take 1.13 GiB, more than the 1 GiB of cpu"
)


@pytest.fixture
def one_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine of 1 GiB, to the size check."""
    from fusedhead.bench import cases

    monkeypatch.setattr(cases, "device_bytes", lambda device: 2**30)


def test_a_demo_past_the_devices_memory_is_refused_before_any_input_is_made(
    fusedhead: Run, one_gib: None
) -> None:
    """Hidden states, weight and one [N, V] GEMM of logits past the device's memory: refused by
    the sizes, where the demo ended in torch's overflow as 'an unexpected failure'."""
    rc, _, err = fusedhead("demo", *SIZES, "--quiet")
    line = error_line(err)
    assert rc == 2 and TOO_LARGE in line, (rc, line)


def test_a_bench_case_past_the_devices_memory_is_recorded_without_building_it(
    fusedhead: Run, one_gib: None, tmp_path: Path
) -> None:
    """The case is recorded as failed by its sizes and the run goes on (nothing else to run
    here: exit 1), where the bench spent 40 s building inputs before a 608 GB allocation failed."""
    out_json = tmp_path / "r.json"
    rc, out, err = fusedhead("bench", *SIZES, "--impl", "torch", "--json", str(out_json))
    assert rc == 1 and TOO_LARGE in out + err, (rc, out, err)
    (record,) = json.loads(out_json.read_text())
    assert record["status"] == "error" and TOO_LARGE in record["error"]
