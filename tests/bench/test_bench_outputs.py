"""``fusedhead bench``'s outputs: where they go, what a failed write says, what a NaN does.

Each output is written whole (a new file renamed over the path): through a symlink its target,
the link kept. A write that fails after the run names its flag and path; a measurement with NaN
errors is an error with a non-zero exit, never a row of NaN with exit 0; the stamped commit is
checked when it is read.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fusedhead import cli
from fusedhead.bench import heads as heads_module
from fusedhead.bench import peers, provenance, results_file

TINY = ["--device", "cpu", "--n", "16", "--hidden", "8", "--vocab", "32", "--reps", "1"]
TINY += ["--no-memory"]


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("fusedhead: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_outputs_through_symlinks_write_their_targets_and_keep_the_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json LINK replaced the link by a regular file; now the target is written. The plot's
    format is the extension given (the link's), not its target's."""
    names = {"--json": "r.json", "--markdown": "t.md", "--plot": "p.png"}
    targets = {flag: tmp_path / "real" / f"target-{i}" for i, flag in enumerate(names)}
    targets["--json"].parent.mkdir()
    targets["--json"].write_text("[]")
    argv = ["bench", *TINY, "--impl", "torch"]
    for flag, name in names.items():
        (tmp_path / name).symlink_to(targets[flag])
        argv += [flag, str(tmp_path / name)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    for flag, name in names.items():
        assert (tmp_path / name).is_symlink() and (tmp_path / name).resolve() == targets[flag]
    (record,) = json.loads(targets["--json"].read_text())
    assert record["impl"] == "torch" and record["status"] == "ok"
    assert "| torch |" in targets["--markdown"].read_text()
    png = targets["--plot"].read_bytes()[:8]
    assert png == b"\x89PNG\r\n\x1a\n" or pytest.importorskip("matplotlib") is None
    assert sorted(p.name for p in targets["--json"].parent.iterdir()) == [
        "target-0",
        "target-1",
        "target-2",
    ]  # no temporary file left beside them


@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_an_output_that_cannot_be_written_after_the_run_names_its_flag_and_path(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk ended the run in a bare '[Errno 28] No space left on device'."""
    if flag == "--plot":
        pytest.importorskip("matplotlib")

    def full_disk(f: Any, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_file, "_write_all", full_disk)
    path = tmp_path / {"--json": "r.json", "--markdown": "t.md", "--plot": "p.png"}[flag]
    rc = cli.main(["bench", *TINY, "--impl", "torch", flag, str(path)])
    out, err = capsys.readouterr()
    line = _error_line(err)
    assert rc == 2 and f"{flag} {path}: could not be written (No space left on device)" in line
    assert list(tmp_path.iterdir()) == []  # the temporary file is removed
    assert "| torch |" in out or flag == "--json"  # the table is still printed


def test_a_measurement_with_nan_errors_is_an_error_and_the_exit_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Log-probs of NaN were a row of NaN errors with exit 0; now they are the row's error."""
    real = peers.full_logits

    def nan_log_probs(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = real(*args)
        return lp * float("nan"), ent

    monkeypatch.setattr(peers, "full_logits", nan_log_probs)
    out_json = tmp_path / "r.json"
    rc = cli.main(["bench", *TINY, "--impl", "reference", "--json", str(out_json)])
    (record,) = json.loads(out_json.read_text())
    assert rc == 1 and record["status"] == "error", record
    assert record["error"].startswith("NaN or inf in log_probs, grad_hidden, grad_weight")
    assert record["fwd_bwd_ms"] > 0  # the times are kept
    assert "reference: error: NaN or inf in log_probs" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("abc1234\n| injected | row |", "a line break"),
        ("abc1234\udcff", "a character that is not ASCII"),  # a byte 0xff, not UTF-8
        ("a" * 81, "81 characters"),
    ],
)
def test_a_stamped_commit_that_is_not_one_short_line_of_ascii_is_refused_before_any_work(
    value: str,
    why: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It failed the Markdown write after the run with a bare encode error, or pasted its
    second line into the table."""
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, value)
    out_json, md = tmp_path / "r.json", tmp_path / "t.md"
    argv = ["bench", *TINY, "--impl", "torch", "--json", str(out_json), "--markdown", str(md)]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    line = _error_line(err)
    assert rc == 2 and line.startswith(f"fusedhead: error: {provenance.GIT_COMMIT_ENV}="), line
    assert "expected one line of printable ASCII of at most 80 characters" in line
    assert why in line and out == "" and not out_json.exists() and not md.exists()


def test_a_stamped_commit_of_printable_ascii_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, " 0123456789abcdef+dirty ")
    assert provenance.versions()["git_commit"] == "0123456789abcdef+dirty"


@pytest.mark.parametrize("flags", [["--no-accuracy"], ["--case", "topk5"]])
def test_nan_outputs_are_an_error_without_a_reference_too(
    flags: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no reference (``--no-accuracy``, or a case that has none) NaN outputs were recorded as
    ``ok`` with their times: only the errors against the reference were checked."""
    real = peers.full_logits

    def nan_log_probs(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = real(*args)
        return lp * float("nan"), ent

    monkeypatch.setattr(peers, "full_logits", nan_log_probs)
    monkeypatch.setattr(heads_module, "build", _nan_head(heads_module.build))
    out_json = tmp_path / "r.json"
    impl = "reference" if flags == ["--no-accuracy"] else "torch"
    rc = cli.main(["bench", *TINY, "--impl", impl, *flags, "--json", str(out_json)])
    (record,) = json.loads(out_json.read_text())
    assert rc == 1 and record["status"] == "error", record
    assert record["error"].startswith("NaN or inf in output"), record["error"]


def _nan_head(build: Any) -> Any:
    """``heads.build`` whose functions return NaN in place of their first output."""

    def nan_build(*args: Any) -> Any:
        fn = build(*args)

        def nan_fn(*inputs: Any) -> Any:
            first, second = fn(*inputs)
            return first * float("nan"), second

        return nan_fn

    return nan_build
