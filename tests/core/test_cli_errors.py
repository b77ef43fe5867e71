"""The ``fusedhead`` command fails in one clean line, reads errors' fields, and says what it does.

Every bad input (a device, a number, ``--options``) ends in ``fusedhead: error: ...`` naming the
flag and a non-zero exit, never a traceback unless ``FUSEDHEAD_TRACEBACK`` asks (then before that
line, same exit); ``--json`` prints the error's fields; ``info`` shows allowed values and never an
ok status on a device this machine lacks; ``--version`` and ``python -m fusedhead`` exist; an
allowlist that hides every backend says so.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from fusedhead import cli, registry
from fusedhead.errors import BackendError, IncompatibleBackendError


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    """The stderr of a failed command: exactly one line, ``fusedhead: error: ...``."""
    lines = [line for line in err.splitlines() if not line.startswith("fusedhead demo: [")]
    assert len(lines) == 1, err
    assert lines[0].startswith("fusedhead: error: "), err
    assert "Traceback" not in err
    return lines[0]


def run_cli(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> Any:
    cmd = (
        [sys.executable, "-m", "fusedhead", *args]
        if code is None
        else [sys.executable, "-c", code, *args]
    )
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


# --- devices and numbers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("demo", "--device", "bogus"),
        ("bench", "--device", "bogus", "--impl", "torch"),
        ("info", "torch", "--device", "bogus"),
    ],
)
def test_a_bogus_device_is_one_line_naming_the_flag(capsys, argv):
    rc, out, err = run_main(capsys, *argv)
    line = one_error_line(err)
    assert rc == 2 and "--device" in line and "'bogus'" in line and "'cuda:1'" in line
    assert "PASS" not in out


@pytest.mark.parametrize(
    "argv", [("check", "Torch"), ("demo", "--backend", "Torch", "--quiet"), ("info", "Torch")]
)
def test_a_capitalised_backend_name_is_named_as_given_not_as_a_config(capsys, argv):
    """Before: check and demo said "FusedHeadConfig: backend name ...", a class never built."""
    rc, _out, err = run_main(capsys, *argv)
    line = one_error_line(err)
    assert rc == 2 and "FusedHeadConfig" not in line, line
    assert "backend name 'Torch' is not valid" in line and "did you mean 'torch'?" in line, line


def test_list_check_with_a_bogus_device_is_one_line(capsys):
    rc, _out, err = run_main(capsys, "list", "--check", "--device", "bogus")
    line = one_error_line(err)
    assert rc == 2 and "--device" in line and "'bogus'" in line


#: What a temperature or a scale takes: the library's range of a call's float scalars.
SCALAR_RANGE = "a finite number > 0 in [2**-126, 2**126] (about 1.2e-38 to 8.5e37)"


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--vocab", "0", "an integer >= 1"),
        ("--n", "-3", "an integer >= 1"),
        ("--hidden", "1.5", "an integer >= 1"),
        ("--reps", "0", "an integer from 1 to 1000"),
        ("--reps", "1001", "an integer from 1 to 1000"),
        ("--seed", "-1", "an integer >= 0"),
        ("--temperature", "0", SCALAR_RANGE),
        ("--temperature", "inf", SCALAR_RANGE),
        ("--temperature", "1e-40", SCALAR_RANGE),
        ("--scale", "nan", SCALAR_RANGE),
        ("--scale", "1e39", SCALAR_RANGE),
    ],
)
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_numeric_arguments_are_checked_naming_the_flag(capsys, command, flag, value, expected):
    rc, out, err = run_main(capsys, command, flag, value)
    line = one_error_line(err)
    assert rc == 2 and f"argument {flag}: must be {expected}, got {value!r}" in line, line
    assert "PASS" not in out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_bench_max_minutes_must_be_a_number_above_zero(capsys, value):
    """0 minutes would skip every measurement: refused, not run into "nothing was measured"."""
    rc, _out, err = run_main(capsys, "bench", "--max-minutes", value)
    line = one_error_line(err)
    assert rc == 2 and f"argument --max-minutes: must be a finite number > 0, got {value!r}" in line


def test_demo_reps_zero_is_refused_not_passed(capsys):
    rc, out, err = run_main(capsys, "demo", "--reps", "0", "--n", "8", "--hidden", "8")
    assert rc == 2 and "PASS" not in out and "--reps" in one_error_line(err)


# --- --options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "check"])
def test_bad_options_json_names_the_flag_and_the_problem(capsys, command):
    argv = [command, "torch"] if command == "check" else [command]
    rc, _out, err = run_main(capsys, *argv, "--options", "{bad")
    line = one_error_line(err)
    assert rc == 2 and "argument --options" in line and "'{bad'" in line
    assert "line 1, column 2" in line and "double quotes" in line


def test_options_that_are_not_an_object_are_refused(capsys):
    rc, _out, err = run_main(capsys, "check", "torch", "--options", "[1, 2]")
    assert rc == 2 and "argument --options: must be a JSON object" in one_error_line(err)


def test_an_invalid_option_lists_the_valid_ones_in_one_line(capsys):
    rc, _out, err = run_main(capsys, "demo", "--options", '{"workspace_mib": true}')
    line = one_error_line(err)
    assert rc == 2 and "option 'workspace_mib' = True (bool): expected int > 0 or None" in line
    assert "chunk_rows: int > 0 or None = None" in line and "pydantic" not in line


# --- errors' fields -----------------------------------------------------------------------------


def test_json_prints_the_error_fields(capsys):
    rc, out, err = run_main(capsys, "info", "no-such-backend", "--json")
    one_error_line(err)
    data = json.loads(out)["error"]
    assert rc == 2 and data["status"] == "unknown" and data["backend"] == "no-such-backend"
    assert data["error"] == "UnknownBackendError" and data["message"] in err


def test_info_status_comes_from_the_error_class(capsys, with_fixture_dists):
    rc, out, _err = run_main(capsys, "info", "incompatible", "--json")
    info = json.loads(out)
    assert rc == 1 and info["status"] == info["error"]["status"]
    assert info["error"]["distribution"] == "fh-fixture-incompatible"
    assert info["error"]["error"] == "IncompatibleBackendError"
    assert info["status"] == IncompatibleBackendError.status


def test_an_error_status_the_cli_does_not_know_is_shown_as_is(capsys, monkeypatch):
    class OddError(BackendError):
        status = "odd-status"

    def boom(name: str) -> Any:
        raise OddError("odd on purpose", backend=name, hint="nothing to do")

    monkeypatch.setattr(registry, "load_class", boom)
    rc, out, _err = run_main(capsys, "info", "torch", "--json")
    info = json.loads(out)
    assert rc == 1 and info["status"] == "odd-status" and info["error"]["hint"] == "nothing to do"


def test_an_unexpected_failure_is_one_line_unless_asked(capsys, monkeypatch):
    def boom(args: Any) -> int:
        raise RuntimeError("kaputt\non two lines")

    monkeypatch.setattr(cli, "_cmd_list", boom)
    rc, _out, err = run_main(capsys, "list")
    line = one_error_line(err)
    assert rc == 1 and "RuntimeError: kaputt on two lines" in line and cli.TRACEBACK_ENV in line
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    rc, _out, err = run_main(capsys, "list")
    assert rc == 1 and err.startswith("Traceback (most recent call last):\n"), err
    assert err.splitlines()[-1].startswith("fusedhead: error: RuntimeError: kaputt on two lines")


def test_the_traceback_variable_shows_where_bad_input_was_refused_too(capsys, monkeypatch):
    """A ValueError is bad input's one line, and may be a bug's too: the variable shows where,
    before the same line and with the same exit status (2)."""
    rc, _out, err = run_main(capsys, "bench", "--n", "-5")
    assert rc == 2 and "--n" in one_error_line(err)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")

    def refuse(args: Any) -> int:
        raise ValueError("refused inside a command")

    monkeypatch.setattr(cli, "_cmd_list", refuse)
    rc, _out, err = run_main(capsys, "list")
    *traceback, line = err.splitlines()
    assert rc == 2 and line == "fusedhead: error: refused inside a command", err
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: refused inside a command"


def test_no_command_is_one_line(capsys):
    rc, _out, err = run_main(capsys)
    assert rc == 2 and "required: command" in one_error_line(err)


# --- info shows allowed values -----------------------------------------------------------------


class ShownOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tile: PositiveInt | None = Field(None, description="tile width")
    mode: Literal["fast", "safe"] = "fast"
    cols: int = Field(8192, ge=16)
    exact: bool | None = None


@pytest.fixture
def shown_backend(variant: Any) -> type:
    return variant("shown-test", Options=ShownOptions)  # type: ignore[no-any-return]


def test_info_prints_allowed_values_not_typing_reprs(capsys, shown_backend):
    rc, out, _err = run_main(capsys, "info", "shown-test", "--device", "cpu")
    assert rc == 0, out
    assert "  tile: int > 0 or None = None  tile width" in out
    assert "  mode: one of 'fast', 'safe' = 'fast'" in out
    assert "  cols: int >= 16 = 8192" in out
    assert "  exact: bool or None = None" in out
    assert "Optional" not in out and "Literal" not in out and "Annotated" not in out
    rc, out, _err = run_main(capsys, "info", "shown-test", "--json", "--device", "cpu")
    types = {r["name"]: r["type"] for r in json.loads(out)["options_schema"]}
    assert types == {
        "tile": "int > 0 or None",
        "mode": "one of 'fast', 'safe'",
        "cols": "int >= 16",
        "exact": "bool or None",
    }


class ChunkOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk: int = Field(description="rows per chunk")


@pytest.fixture
def needs_chunk_backend(variant: Any) -> type:
    return variant("needs-chunk-test", Options=ChunkOptions)  # type: ignore[no-any-return]


def test_info_shows_an_option_without_a_default_as_required(capsys, needs_chunk_backend):
    """Before: pydantic's dump as an 'error' (info built Options() with no value for chunk)."""
    rc, out, _err = run_main(capsys, "info", "needs-chunk-test", "--device", "cpu")
    assert rc == 1, out
    assert "  chunk: int (required)  rows per chunk" in out, out
    assert "status: invalid-options" in out and "option 'chunk' is required: expected int" in out
    assert "'required'" not in out and "errors.pydantic.dev" not in out, out
    rc, out, _err = run_main(capsys, "info", "needs-chunk-test", "--device", "cpu", "--json")
    info = json.loads(out)
    assert info["options_schema"] == [
        {
            "name": "chunk",
            "type": "int",
            "default": None,
            "description": "rows per chunk",
            "required": True,
        }
    ]


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_info_claims_vocab_parallel_outputs_only_for_a_vocab_parallel_backend(
    capsys, ref_backend, vocab_parallel
):
    """Before: 'vocab_parallel_outputs: ('log_probs', 'entropy')' beside 'vocab_parallel: False'."""
    ref_backend.caps = {"vocab_parallel": vocab_parallel}
    rc, out, _err = run_main(capsys, "info", "ref-test", "--device", "cpu")
    assert rc == 0, out
    assert f"  vocab_parallel: {vocab_parallel}" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  vocab_parallel_outputs: "))
    if vocab_parallel:
        assert line == "  vocab_parallel_outputs: ['log_probs', 'entropy']"
    else:
        assert line == "  vocab_parallel_outputs: none (vocab_parallel is False)"
    rc, out, _err = run_main(capsys, "info", "ref-test", "--device", "cpu", "--json")
    caps = json.loads(out)["capabilities"]  # --json: the declaration as the backend made it
    assert caps["vocab_parallel"] is vocab_parallel
    assert caps["vocab_parallel_outputs"] == ["log_probs", "entropy"]


# --- the allowlist, --version, python -m fusedhead ---------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    import os

    return {**os.environ, **extra}


def test_an_allowlist_that_hides_everything_says_so(with_fixture_dists):
    proc = run_cli("list", env=_env(FUSEDHEAD_BACKENDS="typo"))
    assert proc.returncode == 0, proc.stderr
    assert "no backends installed" not in proc.stdout
    assert "FUSEDHEAD_BACKENDS='typo' hides" in proc.stdout
    for name in ("good", "broken", "torch"):
        assert name in proc.stdout
    assert "names 'typo', which nothing installs" in proc.stdout
    proc = run_cli("list", "--json", env=_env(FUSEDHEAD_BACKENDS="typo"))
    assert json.loads(proc.stdout) == [] and "hides" in proc.stderr


def test_an_allowlist_names_what_it_hides_beside_what_it_shows(with_fixture_dists):
    proc = run_cli("list", env=_env(FUSEDHEAD_BACKENDS="good,godo"))
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    assert rows[1].split()[:2] == ["good", "fh-fixture-good"]
    assert "hides" in rows[-1] and "broken" in rows[-1] and "did you mean 'good'?" in rows[-1]


def test_version_lists_core_and_backend_distributions_without_importing(with_fixture_dists):
    code = (
        "import sys; from fusedhead.cli import main; rc = main(['--version']); "
        "assert 'torch' not in sys.modules, 'imported torch'; "
        "assert not [m for m in sys.modules if m.startswith(('fh_fixture', 'fusedhead_'))], 'imported a backend'; "
        "sys.exit(rc)"
    )
    proc = run_cli(code=code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"fusedhead {md.version('fusedhead')}"
    assert f"fusedhead-torch {md.version('fusedhead-torch')} (backend torch)" in lines
    assert "fh-fixture-broken 1.0.0 (backend broken)" in lines  # listed, never imported
    assert lines[-1].startswith("python ")
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == lines[0]


def test_python_m_fusedhead_list():
    proc = run_cli("list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split()[:4] == ["NAME", "DISTRIBUTION", "VERSION", "STATUS"]
    assert "torch" in proc.stdout


# --- demo says what it is doing ------------------------------------------------------------------


def test_demo_prints_progress_to_stderr_and_the_report_to_stdout(capsys):
    argv = ["demo", "--n", "16", "--hidden", "8", "--vocab", "32", "--reps", "1", "--no-memory"]
    rc, out, err = run_main(capsys, *argv)
    assert rc == 0 and "PASS" in out, out + err
    steps = [line for line in err.splitlines() if line.startswith("fusedhead demo: [")]
    assert len(steps) >= 5, err
    assert any("float64 reference" in s for s in steps) and steps[-1].endswith("done")
    assert "fusedhead demo: [" not in out
    rc, out, err = run_main(capsys, *argv, "--quiet")
    assert rc == 0 and "PASS" in out and err == ""


@pytest.fixture
def cuda_only_backend(variant: Any) -> type:
    from fusedhead.protocol import Capabilities

    def capabilities(self: Any, device: Any) -> Capabilities:
        return Capabilities(devices=("cuda",))

    return variant("cuda-only-test", capabilities=capabilities)  # type: ignore[no-any-return]


def test_demo_on_a_backend_that_cannot_run_here_is_one_error_line(capsys, cuda_only_backend):
    argv = ["demo", "--backend", "cuda-only-test", "--n", "8", "--hidden", "8", "--vocab", "16"]
    rc, out, err = run_main(capsys, *argv, "--quiet")
    line = one_error_line(err)
    assert rc == 2 and "backend 'cuda-only-test'" in line and "cannot run this problem" in line
    assert "PASS" not in out


def test_a_missing_file_is_one_error_line(capsys, tmp_path):
    missing = tmp_path / "none.json"
    rc, _out, err = run_main(capsys, "bench", "--report-only", "--json", str(missing))
    line = one_error_line(err)
    assert rc == 2 and str(missing) in line and "No such file" in line


@pytest.mark.parametrize(
    "argv", [["demo", "--n", "8"], ["bench", "--n", "8"], ["check", "torch"]], ids=lambda a: a[0]
)
def test_a_cuda_device_that_is_not_here_is_one_error_line(capsys, argv):
    """Every command takes cuda:K as a device and refuses one this machine lacks, naming it."""
    rc, out, err = run_main(capsys, *argv, "--device", "cuda:99")
    line = one_error_line(err)
    assert rc == 2 and "--device cuda:99" in line and "PASS" not in out
    assert "CUDA is not available here" in line or "CUDA device(s)" in line


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"], ["check", "torch", "--list"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(argv):
    """``fusedhead list | head -c 5``: no traceback, the shell's status for SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fusedhead", *argv], stdout=write_end, stderr=subprocess.PIPE,
            text=True, check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE
    assert proc.stderr == ""


# --- each sub-command's --help, bench's output paths, demo --model ------------------------------


@pytest.mark.parametrize("command", ["list", "info", "check", "bench", "demo"])
def test_each_sub_command_help_says_what_it_does(capsys, command):
    rc, out, _err = run_main(capsys, command, "--help")
    assert rc == 0
    intro = out.split("\n\n")[1]  # after the usage: the description, before the arguments
    assert not intro.startswith(("options:", "positional arguments:")), out
    words = " ".join(intro.split())
    top = cli.build_parser(delegated=False)._subparsers._group_actions[0]  # type: ignore[union-attr]
    summary = next(a.help for a in top._choices_actions if a.dest == command)
    assert summary and words.lower().startswith(summary.lower()), (words, summary)


def test_info_name_says_what_it_takes(capsys):
    _rc, out, _err = run_main(capsys, "info", "--help")
    assert "backend name" in out


def test_info_without_a_name_lists_the_installed_names(capsys):
    """Before: argparse's "the following arguments are required: name", and no names."""
    rc, _out, err = run_main(capsys, "info")
    assert rc == 2 and err.startswith("fusedhead: error: info needs a backend name; installed: ")
    assert "torch" in err.split("installed: ")[1]
    rc, out, _err = run_main(capsys, "info", "--json")  # the error's fields, as JSON
    assert rc == 2 and json.loads(out)["error"]["message"].startswith("info needs a backend name")


TINY = ["--impl", "torch", "--n", "8", "--hidden", "8", "--vocab", "16", "--no-memory"]


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_bench_output_under_a_file_is_refused_before_any_work(capsys, tmp_path, flag):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "out.png"
    rc, out, err = run_main(capsys, "bench", *TINY, flag, str(target))
    line = one_error_line(err)  # one line: no progress lines, nothing was measured
    assert rc == 2 and line.startswith(f"fusedhead: error: {flag} {target}:"), line
    assert "is a file, not a folder" in line and "|" not in out  # no table either


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_bench_output_that_is_a_folder_is_refused_before_any_work(capsys, tmp_path, flag):
    rc, _out, err = run_main(capsys, "bench", *TINY, flag, str(tmp_path))
    line = one_error_line(err)
    assert rc == 2 and f"{flag} {tmp_path}: is a folder" in line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_bench_output_in_a_folder_that_takes_no_file_is_refused_before_any_work(capsys, flag):
    """/proc takes no new file, though os.access says it does to root: the file's creation is
    tried, and its own error is told (not one about the folder, which exists)."""
    rc, out, err = run_main(capsys, "bench", *TINY, flag, "/proc/bench.out")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"fusedhead: error: {flag} /proc/bench.out:"), line
    assert "the file cannot be created (No such file or directory)" in line, line
    assert "folder" not in line and "|" not in out


def test_bench_plot_in_a_format_matplotlib_does_not_write_is_refused_first(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, _out, err = run_main(capsys, "bench", *TINY, "--plot", str(tmp_path / "bench.txt"))
    line = one_error_line(err)
    assert rc == 2 and "--plot" in line and "'txt'" in line and "png" in line


def test_bench_output_folders_that_do_not_exist_yet_are_made(capsys, tmp_path):
    md = tmp_path / "a" / "b" / "bench.md"
    rc, _out, _err = run_main(
        capsys, "bench", *TINY, "--markdown", str(md), "--max-minutes", "1e-9"
    )
    assert md.is_file() and rc == 1  # written, though nothing was measured (the time cap)


def test_bench_append_needs_json(capsys):
    rc, _out, err = run_main(capsys, "bench", *TINY, "--append")
    line = one_error_line(err)
    assert rc == 2 and "--append" in line and "--json" in line


@pytest.mark.parametrize("mode", [["--report-only"], ["--append", *TINY]])
def test_bench_results_that_are_not_json_name_the_file_and_the_flag(capsys, tmp_path, mode):
    bad = tmp_path / "notes.txt"
    bad.write_text("not json\n")
    rc, _out, err = run_main(capsys, "bench", *mode, "--json", str(bad))
    line = one_error_line(err)
    assert rc == 2 and f"--json {bad}" in line and "JSON list" in line, line


@pytest.mark.parametrize("other", ["--markdown", "--plot"])
def test_bench_outputs_sharing_one_path_are_refused_before_any_work(capsys, tmp_path, other):
    same = tmp_path / "results.json"
    rc, out, err = run_main(capsys, "bench", *TINY, "--json", str(same), other, str(same))
    line = one_error_line(err)
    assert rc == 2 and "--json" in line and other in line and "same file" in line, line
    assert not same.exists() and "running" not in out


@pytest.mark.parametrize(
    ("content", "why"),
    [("[1, 2]", "item 0 is not a result"), ("[{}]", "no 'case', 'impl', 'status'")],
)
@pytest.mark.parametrize("mode", [["--report-only"], ["--append", *TINY]])
def test_bench_results_whose_items_are_not_results_name_the_item(
    capsys, tmp_path, mode, content, why
):
    bad = tmp_path / "list.json"
    bad.write_text(content)
    rc, _out, err = run_main(capsys, "bench", *mode, "--json", str(bad))
    line = one_error_line(err)
    assert rc == 2 and f"--json {bad}" in line and why in line, line
    assert bad.read_text() == content  # nothing measured, nothing written


@pytest.mark.parametrize("command", ["bench", "list", "demo"])
def test_an_unknown_flag_points_to_the_subcommands_own_help(capsys, command):
    rc, _out, err = run_main(capsys, command, "--frobnicate")
    line = one_error_line(err)
    assert rc == 2 and "--frobnicate" in line and f"(see fusedhead {command} --help)" in line, line


def test_bench_a_top_k_larger_than_the_vocabulary_is_refused_before_any_work(capsys, tmp_path):
    out = tmp_path / "r.json"
    rc, _out, err = run_main(capsys, "bench", *TINY, "--case", "topk100", "--json", str(out))
    line = one_error_line(err)
    assert rc == 2 and "--case topk100" in line and "--vocab 16" in line, line
    assert not out.exists()


def test_demo_unknown_model_is_one_error_line_on_stderr(capsys):
    pytest.importorskip("transformers")
    rc, out, err = run_main(capsys, "demo", "--model", "nope", "--quiet")
    line = one_error_line(err)
    assert rc == 2 and "--model nope" in line and "tiny-llama" in line and out == ""


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--n", "10", "--temperature", "2"], "--n, --temperature set"),
        (["--seed", "3"], "--seed sets"),
    ],
)
def test_demo_model_refuses_the_synthetic_problems_flags_by_name(capsys, flags, named):
    """``--model`` runs its own model and batch: a flag it would not read is refused, not ignored."""
    rc, out, err = run_main(capsys, "demo", "--model", "tiny-llama", *flags, "--quiet")
    line = one_error_line(err)
    assert rc == 2 and named in line and "drop --model" in line and out == ""


SMALL = ("--n", "4", "--hidden", "8", "--vocab", "16", "--no-memory")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("demo", "--quiet", *SMALL), "--seed"),
        (("bench", "--impl", "torch", *SMALL), "--seed"),
        (("demo", "--quiet", "--hidden", "8"), "--n"),
        (("bench", "--impl", "torch", "--hidden", "8"), "--n"),
    ],
)
@pytest.mark.parametrize("value", [str(2**63), "99999999999999999999999"])
def test_an_integer_beyond_int64_is_refused_naming_the_flag(capsys, argv, flag, value):
    """Before: 'Overflow when unpacking long long' (a seed) or torch's randn() error (a size),
    naming no flag, after the run had started."""
    rc, out, err = run_main(capsys, *argv, flag, value)
    line = one_error_line(err)
    assert rc == 2 and f"argument {flag}: must be an integer >=" in line, line
    assert "fits in int64 (at most 2**63 - 1)" in line and repr(value) in line and not out


def test_the_largest_seed_runs(capsys):
    rc, out, _err = run_main(
        capsys,
        "demo",
        "--seed",
        str(2**63 - 1),
        "--n",
        "8",
        "--hidden",
        "8",
        "--vocab",
        "16",
        "--reps",
        "1",
        "--no-memory",
        "--quiet",
    )
    assert rc == 0 and "PASS" in out


def test_list_check_on_a_cuda_device_this_machine_lacks_is_refused(capsys, monkeypatch):
    """Before: 'list --check --device cuda' without CUDA probed there and listed a backend that
    does not test for CUDA itself as ok, where 'fusedhead check' refuses the device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run_main(capsys, "list", "--check", "--device", "cuda")
    line = one_error_line(err)
    assert rc == 2 and "--device cuda" in line and "CUDA is not available" in line
    assert " ok" not in out


def test_info_on_a_cuda_device_this_machine_lacks_never_says_ok(capsys, monkeypatch, ref_backend):
    """``info`` describes a device whether or not it is here (exit 0), but its status is this
    machine's. Before: a backend whose check() does not test for CUDA itself showed 'status: ok'
    on CUDA without CUDA, what 'list --check --device cuda' refuses the device for; now
    'unavailable' with list --check's reason."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, _err = run_main(capsys, "info", "ref-test", "--device", "cuda", "--json")
    info = json.loads(out)
    assert rc == 0 and info["device"] == "cuda", out
    assert info["status"] == "unavailable" and info["reason"] == (
        "device cuda: CUDA is not available here (torch sees no CUDA device)"
    )
    assert info["per_device"]["cuda"]["status"] == "unavailable"
    assert info["per_device"]["cpu"]["status"] == "ok"  # a device that is here: its probe's
    rc, out, _err = run_main(capsys, "info", "ref-test")  # cpu shown; cuda's row says it too
    assert rc == 0 and "status ok" not in next(
        ln for ln in out.splitlines() if ln.startswith("  cuda")
    )
    _rc, _out, err = run_main(capsys, "list", "--check", "--device", "cuda")
    assert "CUDA is not available here (torch sees no CUDA device)" in one_error_line(err)


def test_list_check_with_an_empty_device_is_one_line(capsys):
    """Before: '--device ""' counted as absent, and each backend listed as broken with
    'probe failed: RuntimeError: Device string must not be empty', exit 1."""
    rc, out, err = run_main(capsys, "list", "--check", "--device", "")
    line = one_error_line(err)
    assert rc == 2 and "--device" in line and "got ''" in line and "broken" not in out


def test_info_usage_shows_the_backend_name_as_required(capsys: pytest.CaptureFixture[str]) -> None:
    """``fusedhead info`` needs a name; its usage says so (argparse would show ``[name]``)."""
    from fusedhead.cli import main

    assert main(["info", "--help"]) == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.endswith(" name") and "[name]" not in usage, usage


def test_demo_refuses_a_scale_whose_logits_overflow(capsys):
    """Before: the demo made inf inputs itself, then blamed the backend's accuracy (FAIL)."""
    rc, out, err = run_main(capsys, "demo", "--scale", "8e37", "--quiet")
    line = one_error_line(err)
    assert rc == 2 and line.startswith("fusedhead: error: --scale 8e+37 with --dtype fp32"), line
    assert "expected --scale <=" in line and "FAIL" not in out


def test_demo_with_an_empty_model_name_is_refused_not_the_synthetic_demo(capsys):
    """Before: --model '' ran the synthetic demo, as if no --model was given."""
    rc, out, err = run_main(capsys, "demo", "--model", "")
    line = one_error_line(err)
    assert rc == 2 and "unknown demo model ''" in line and "tiny-llama" in line, line
    assert "PASS" not in out


@pytest.mark.parametrize(
    "argv", [("check", "torch", "-k", "nomatch"), ("check", "torch", "--options", "x")]
)
def test_an_argument_the_parser_refuses_is_json_with_json(capsys, argv):
    """With --json every error's fields are printed on stdout; an argument the parser refused
    printed only its line on stderr."""
    rc, out, err = run_main(capsys, *argv, "--json")
    assert rc == 2 and err.startswith("fusedhead: error: check: argument ")
    fields = json.loads(out)["error"]
    assert fields["error"] == "UsageError" and fields["status"] == "error"
    assert err.strip() == f"fusedhead: error: {fields['message']}"
    rc, out, err = run_main(capsys, *argv)  # without --json: the line alone
    assert rc == 2 and out == "" and err.startswith("fusedhead: error: check: argument ")
