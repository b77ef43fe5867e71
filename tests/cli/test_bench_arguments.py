"""``fusedhead bench`` refuses, before any work and by name, a run that could not go as asked.

An implementation with no case to run, a grid value given twice, measurement arguments that
``--report-only`` would ignore, an output file that cannot be created (its own reason), and
JSON values named by JSON's type names.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
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
        # in another spelling, or through the flag again (before: topk5 topk05 ran twice)
        ("--case", ["topk5", "topk05"], "topk5"),
        ("--case", ["gather3", "--case", "gather003"], "gather3"),
        ("--n", ["8", "--n", "08"], "8"),
        ("--scale", ["4", "--scale", "4e0"], "4.0"),
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


# --- outputs: a regular file, or a symlink followed to one ---------------------------------------


def _special_file(kind: str, where: Path) -> Path:
    """A path that exists and is no regular file: a named pipe, or a device like /dev/null
    (``mknod``, which needs root), made here, never the system's own."""
    path = where / kind
    if kind == "pipe":
        os.mkfifo(path)
        return path
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    return path


@pytest.fixture
def pipe_reader() -> Iterator[Callable[[Path], None]]:
    """A reader kept open on the pipes the tests make, so that a write to one never waits."""
    opened: list[int] = []

    def open_reader(path: Path) -> None:
        opened.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))

    yield open_reader
    for fd in opened:
        os.close(fd)


@pytest.mark.parametrize("link", [False, True], ids=["itself", "through a symlink"])
@pytest.mark.parametrize("kind", ["pipe", "device"])
@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_as_it_is(
    fusedhead: Run,
    tmp_path: Path,
    pipe_reader: Callable[[Path], None],
    flag: str,
    kind: str,
    link: bool,
) -> None:
    """Each write makes a new file renamed over the path: --json /dev/null (as root) turned the
    device into a regular file. Anything there that is not a regular file is refused first."""
    special = _special_file(kind, tmp_path)
    if kind == "pipe":
        pipe_reader(special)
    given = special
    if link:
        given = tmp_path / "out.png"
        given.symlink_to(special)
    rc, out, err = fusedhead("bench", *TINY, "--impl", "torch", flag, str(given))
    line = error_line(err)
    assert rc == 2 and f"{flag} {given}: " in line and "not a regular file" in line, line
    assert ("a symlink to" in line) == link and out == ""
    mode = special.lstat().st_mode
    assert stat.S_ISFIFO(mode) if kind == "pipe" else stat.S_ISCHR(mode)
    assert given.is_symlink() == link


@pytest.mark.parametrize("kind", ["pipe", "device"])
def test_results_to_report_that_are_not_a_regular_file_are_refused(
    fusedhead: Run, tmp_path: Path, kind: str
) -> None:
    """A pipe would be read for ever, a device read as no results."""
    special = _special_file(kind, tmp_path)
    rc, out, err = fusedhead("bench", "--report-only", "--json", str(special))
    line = error_line(err)
    assert rc == 2 and f"--json {special}: " in line and "not a regular file" in line, line
    assert out == ""


def test_a_plot_path_without_an_extension_is_refused_by_name(
    fusedhead: Run, tmp_path: Path
) -> None:
    """matplotlib wrote ``out.png`` for ``--plot out``: a file no check had seen."""
    plot = tmp_path / "out"
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", "--plot", str(plot))
    line = error_line(err)
    assert rc == 2 and f"--plot {plot}: no extension to name the format" in line, line
    assert f"{plot}.png" in line and not list(tmp_path.iterdir())


# --- the grid: values the dtype holds, sizes bounded, lists that add up --------------------------


@pytest.mark.parametrize(
    ("scale", "dtype", "temperature"),
    [
        ("1e6", "fp16", "0.7"),
        ("3e4", "fp16", "0.7"),
        ("8e37", "bf16", "0.7"),
        ("1", "fp32", "2e-38"),
    ],
)
def test_a_scale_whose_logits_overflow_the_dtype_is_refused_before_any_work(
    fusedhead: Run, tmp_path: Path, scale: str, dtype: str, temperature: str
) -> None:
    """--scale 1e6 --dtype fp16 measured NaN errors and exited 0."""
    out_json = tmp_path / "r.json"
    rc, out, err = fusedhead(
        "bench", "--device", "cpu", "--n", "64", "--hidden", "32", "--vocab", "500",
        "--reps", "1", "--no-memory", "--impl", "torch", "--dtype", dtype, "--scale", scale,
        "--temperature", temperature, "--json", str(out_json),
    )  # fmt: skip
    line = error_line(err)
    assert rc == 2 and line.startswith(f"fusedhead: error: --scale {float(scale):g} "), line
    assert f"--dtype {dtype}" in line and f"past {dtype}'s largest value" in line
    assert "expected --scale <=" in line and not out_json.exists() and out == ""


def test_the_largest_scale_the_check_takes_runs_with_finite_errors(
    fusedhead: Run, tmp_path: Path
) -> None:
    """The bound is not too tight to use: fp16 at the scale it names runs, every error finite."""
    out_json = tmp_path / "r.json"
    argv = ["bench", "--device", "cpu", "--n", "64", "--hidden", "32", "--vocab", "500"]
    argv += ["--reps", "1", "--no-memory", "--impl", "torch", "--dtype", "fp16"]
    rc, _out, err = fusedhead(*argv, "--scale", "1e6")
    largest = error_line(err).split("expected --scale <= ")[1].split(" ")[0]
    rc, _out, _err = fusedhead(*argv, "--scale", largest, "--json", str(out_json))
    (record,) = json.loads(out_json.read_text())
    assert rc == 0 and record["status"] == "ok", record
    assert all(e["rel"] < 1 for e in record["errors"].values())


@pytest.mark.parametrize(
    ("case", "k", "size"),
    [("gather99999999999", "K", "99999999999"), ("gather17", "K", "17"), ("topk17", "k", "17")],
)
def test_a_head_case_of_more_ids_than_the_vocabulary_is_refused(
    fusedhead: Run, case: str, k: str, size: str
) -> None:
    """gather<K> had no bound: gather99999999999 ended in the allocator's error."""
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", "--case", case)
    line = error_line(err)
    assert rc == 2 and f"--case {case}: {k} = {size} is larger than --vocab 16" in line, line
    assert f"expected {k} <= 16" in line


def test_a_gather_case_past_the_devices_memory_counts_its_ids(
    fusedhead: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gather1000000 ran with 2.27 GiB of ids the memory check did not count: here 16 MiB
    hold the inputs and the logits (8.5 MB) but not 512 x 4000 ids, log-probs and gradients."""
    from fusedhead.bench import cases

    monkeypatch.setattr(cases, "device_bytes", lambda device: 16 << 20)
    out_json = tmp_path / "r.json"
    argv = ["bench", "--device", "cpu", "--n", "512", "--hidden", "16", "--vocab", "4000"]
    argv += ["--reps", "1", "--no-memory", "--impl", "torch", "--json", str(out_json)]
    rc, out, err = fusedhead(*argv, "--case", "logprobs", "gather4000")
    by_head = {r["case"]["head"]: r for r in json.loads(out_json.read_text())}
    assert by_head["logprobs"]["status"] == "ok" and rc == 1, (rc, err)
    gather = by_head["gather4000"]
    assert gather["status"] == "error" and "--case gather4000 (fp32)" in gather["error"]
    assert "the [N, K] gathered ids" in gather["error"] and "more than the 0.0156 GiB" in out + err


@pytest.mark.parametrize(
    ("given", "measured"),
    [
        (["--n", "8", "--impl", "torch", "--impl", "reference"], {("torch", 8), ("reference", 8)}),
        (["--impl", "torch", "--n", "8", "--n", "16"], {("torch", 8), ("torch", 16)}),
        (["--impl", "torch", "--n", "8", "--impl", "reference"], {("torch", 8), ("reference", 8)}),
    ],
)
def test_a_list_flag_given_again_adds_to_its_list(
    fusedhead: Run, tmp_path: Path, given: list[str], measured: set[tuple[str, int]]
) -> None:
    """``--impl torch --impl reference`` measured reference alone (argparse kept the last)."""
    out_json = tmp_path / "r.json"
    argv = ["bench", "--device", "cpu", "--hidden", "8", "--vocab", "16", "--reps", "1"]
    rc, _out, err = fusedhead(*argv, "--no-memory", *given, "--json", str(out_json))
    records = json.loads(out_json.read_text())
    assert rc == 0 and {(r["impl"], r["case"]["n"]) for r in records} == measured, err


def test_a_list_flag_given_once_replaces_its_default(fusedhead: Run, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    rc, _out, _err = fusedhead(
        "bench", *TINY, "--device", "cpu", "--impl", "torch", "--scale", "4", "--json",
        str(out_json),
    )  # fmt: skip
    assert rc == 0 and [r["case"]["scale"] for r in json.loads(out_json.read_text())] == [4.0]


@pytest.mark.parametrize(
    ("flag", "text"),
    [
        ("--n", "٣"),
        ("--hidden", "８"),
        ("--reps", "١"),
        ("--seed", "1_0"),
        ("--vocab", " 16"),
        ("--scale", "١.٥"),
        ("--temperature", "٠.٧"),
        ("--max-minutes", "٣"),
    ],
)
def test_a_number_in_other_digits_than_ascii_is_refused_by_its_flag(
    fusedhead: Run, flag: str, text: str
) -> None:
    """``--n ٣`` (an Arabic-Indic three) ran as --n 3: int() takes any script's digits."""
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", flag, text)
    line = error_line(err)
    assert rc == 2 and f"argument {flag}: must be written with the ASCII digits 0-9" in line
    assert repr(text) in line, line


@pytest.mark.parametrize("name", ["topk٣", "gather５", "topk5\n"])
def test_a_case_name_in_other_digits_or_with_a_line_break_is_refused(
    fusedhead: Run, name: str
) -> None:
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", "--case", name)
    line = error_line(err)
    assert rc == 2 and f"--case {name!r} is not a head case" in line, line


# --- results read back: every field the table reads, typed --------------------------------------

GOOD_RESULT = {
    "case": {"n": 8, "hidden": 4, "vocab": 10, "dtype": "fp32", "scale": 1.0},
    "impl": "x", "status": "ok", "fwd_units": 1.5, "fwd_bwd_units": 4.0, "unit_ms": 2.0,
    "fwd_bwd_ms": 8.0, "peak_extra_bytes": None, "date": "2026-12-06T12:00:00+00:00",
    "errors": {"log_probs": {"rel": 1e-7, "max_abs": 1e-6}, "entropy": None},
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("fwd_units", "fast", "'fwd_units' is \"fast\", a JSON string; expected a number"),
        ("case.n", "a", "'case.n' is \"a\", a JSON string; expected an integer >= 1"),
        ("case.n", True, "'case.n' is true, a JSON boolean; expected an integer >= 1"),
        ("case.vocab", 0, "'case.vocab' is 0, a JSON number; expected an integer >= 1"),
        ("case.scale", "4", "'case.scale' is \"4\", a JSON string; expected a finite number > 0"),
        ("impl", "a\nb", "'impl' is \"a\\nb\", a JSON string; expected an implementation's name"),
        ("status", "OK", '\'status\' is "OK", a JSON string; expected "ok", "skipped" or "error"'),
        ("errors", {"log_probs": 1e-7}, "'errors' is {\"log_probs\": 1e-07}, a JSON object"),
        ("date", 2026, "'date' is 2026, a JSON number; expected a string"),
        ("entropy", "no", "'entropy' is \"no\", a JSON string; expected true or false"),
    ],
)
@pytest.mark.parametrize("mode", ["--report-only", "--append"])
def test_results_whose_fields_have_the_wrong_type_are_refused_naming_item_field_and_value(
    fusedhead: Run, tmp_path: Path, mode: str, field: str, value: object, shown: str
) -> None:
    """A result with ``"fwd_units": "fast"`` let a whole run happen, then failed in the table's
    sort or format (or rendered it with exit 0): the file is checked when it is read."""
    bad = json.loads(json.dumps(GOOD_RESULT))
    where = bad["case"] if field.startswith("case.") else bad
    where[field.removeprefix("case.")] = value
    results = tmp_path / "r.json"
    results.write_text(json.dumps([GOOD_RESULT, bad]))
    before = results.read_text()
    argv = ["--report-only"] if mode == "--report-only" else [*TINY, "--impl", "torch", "--append"]
    rc, out, err = fusedhead("bench", *argv, "--json", str(results))
    line = error_line(err)
    assert rc == 2 and f"--json {results}: item 1 is not a result" in line and shown in line, line
    assert out == "" and results.read_text() == before


def test_results_of_the_right_types_are_reported(fusedhead: Run, tmp_path: Path) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps([GOOD_RESULT]))
    rc, out, _err = fusedhead("bench", "--report-only", "--json", str(results))
    assert rc == 0 and "| 8 | 4 | 10 | fp32 | x | 2.00 | 1.50 | 4.00 | 8.0 | - | 1.0e-07 |" in out


def test_a_small_temperature_is_bounded_by_fp32_not_by_the_inputs_dtype() -> None:
    """The logits are formed in the inputs' dtype but divided by the temperature in fp32 (the
    statistics): fp16 at T = 1e-4 runs; fp32's range bounds the quotient."""
    from fusedhead.bench.cases import Case, refuse_overflow

    refuse_overflow([Case(64, 32, 500, "fp16", temperature=1e-4)])
    with pytest.raises(ValueError, match=r"past fp32.s largest value .* a larger --temperature"):
        refuse_overflow([Case(64, 32, 500, "fp16", temperature=2e-38)])
    with pytest.raises(ValueError, match=r"past fp16.s largest value .* or --dtype bf16 or fp32"):
        refuse_overflow([Case(64, 32, 500, "fp16", scale=1e6)])


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_reps_past_the_most_a_measurement_takes_are_refused(fusedhead: Run, command: str) -> None:
    """--max-minutes is read between measurements: --reps 1e11 ran on past it (a hung run)."""
    argv = [command, "--reps", "100000000000"]
    rc, out, err = fusedhead(*(argv if command == "demo" else [*argv, "--impl", "torch"]))
    line = error_line(err)
    assert rc == 2 and "--reps: must be an integer from 1 to 1000, got '100000000000'" in line
    assert "running" not in out


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_an_empty_output_path_is_refused(fusedhead: Run, flag: str) -> None:
    """ "" wrote nothing and exited 0."""
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "torch", flag, "")
    line = error_line(err)
    assert rc == 2 and f"{flag} '': an empty path" in line, line


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["--impl", "verl-chunkd"], "did you mean 'verl-chunked'?"),
        (["--impl", "refernce"], "did you mean 'reference'?"),
        (["--impl", "torch", "--case", "logprob"], "did you mean 'logprobs'?"),
    ],
)
def test_a_misspelled_peer_or_case_gets_a_did_you_mean(
    fusedhead: Run, argv: list[str], hint: str
) -> None:
    rc, _out, err = fusedhead("bench", *TINY, *argv)
    line = error_line(err)
    assert rc == 2 and hint in line, line


def test_a_backend_hidden_by_fusedhead_backends_is_not_called_uninstalled(
    fusedhead: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSEDHEAD_BACKENDS", "torch")
    rc, _out, err = fusedhead("bench", *TINY, "--impl", "triton")
    line = error_line(err)
    assert rc == 2 and "installed, but FUSEDHEAD_BACKENDS hides it" in line, line
    assert "neither an installed" not in line
