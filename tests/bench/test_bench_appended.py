"""Results that ``--append`` puts together: the plot, the table and the ``run`` object say what
each result is, and a failure to render them is the bench's own fault, not bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusedhead import cli
from fusedhead.bench import peers, report
from fusedhead.bench.cases import Case

SMALL = ["--n", "64", "--hidden", "32", "--vocab", "1000", "--device", "cpu", "--reps", "1"]


@pytest.fixture
def torch_backend() -> None:
    pytest.importorskip("fusedhead_torch", reason="needs fusedhead-torch installed")


def result(
    n: int = 64,
    *,
    date: str = "2026-12-07T10:00:00+00:00",
    device: str = "CPU X",
    temperature: float = 0.7,
    commit: str = "aaaaaaa",
    reference: str | None = "float64",
    fwd_bwd_units: float = 2.0,
) -> dict[str, Any]:
    """One ``ok`` result as ``fusedhead bench --json`` writes it (the fields the report reads)."""
    cuda = device.startswith("NVIDIA")
    return {
        "case": Case(n, 32, 1000, temperature=temperature).to_dict(),
        "impl": "torch",
        "status": "ok",
        "date": date,
        "device": {"type": "cuda", "name": device}
        if cuda
        else {"type": "cpu", "name": device, "cores": 2},
        "versions": {"torch": "2.13.0", "git_commit": commit},
        "environment": {},
        "reference_dtype": reference,
        "errors": {"log_probs": {"rel": 1e-7}} if reference else None,
        "fwd_units": 1.0,
        "fwd_bwd_units": fwd_bwd_units,
        "fwd_bwd_ms": 1.0,
        "unit_ms": 0.5,
        "unit_spread": 1.0,
        "peak_extra_bytes": 1 << 20,
    }


def table_rows(table: str) -> list[dict[str, str]]:
    """The Markdown table's rows as ``{column: cell}``."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]


def test_a_case_measured_again_with_append_is_plotted_and_listed_by_date(
    torch_backend: None, tmp_path: Path
) -> None:
    """Before: the second run's --plot compared two results' dicts ('<' not supported between
    'dict' and 'dict') and the command ended in 'bad input' (exit 2) after measuring."""
    out, png, md = tmp_path / "ap.json", tmp_path / "ap.png", tmp_path / "ap.md"
    argv = ["bench", *SMALL, "--impl", "torch", "--no-memory", "--json", str(out)]
    assert cli.main([*argv, "--plot", str(png)]) == 0
    assert cli.main([*argv, "--append", "--plot", str(png), "--markdown", str(md)]) == 0
    first, again = json.loads(out.read_text())
    assert png.stat().st_size > 0
    rows = table_rows(md.read_text())  # every result is a row, each with its date
    assert [r["measured"] for r in rows] == [first["date"], again["date"]]
    ((label, points),) = next(iter(report.plot_series([first, again]).values())).items()
    assert label == "torch" and points == [again]  # the plot draws the latest


def test_report_only_plots_results_that_differ_only_in_date(tmp_path: Path) -> None:
    """Before: two results of one case at one setting made --report-only --plot exit 2."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    earlier = result(date="2026-12-07T10:00:00+00:00", fwd_bwd_units=5.0)
    later = result(date="2026-12-07T11:00:00+00:00", fwd_bwd_units=3.0)
    out.write_text(json.dumps([later, earlier, result(128)]))
    assert cli.main(["bench", "--report-only", "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    (lines,) = report.plot_series([later, earlier, result(128)]).values()
    assert [(r["case"]["n"], r["fwd_bwd_units"]) for r in lines["torch"]] == [(64, 3.0), (128, 2.0)]


def test_results_of_other_devices_temperatures_or_versions_are_never_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: the plot grouped by (H, V, dtype, scale) and drew one line per implementation,
    so a CPU and a GPU run, or runs at two temperatures, were points of one line (and two of
    them at one N ended the plot in a TypeError)."""
    plt = pytest.importorskip("matplotlib.pyplot", reason="the plot needs matplotlib")
    settings = [  # each its own fwd+bwd units, to tell which setting a drawn point is
        ({}, 2.0),
        ({"device": "NVIDIA H100 80GB HBM3"}, 3.0),
        ({"temperature": 1.0}, 4.0),
        ({"commit": "bbbbbbb"}, 5.0),
    ]
    records = [result(n, **kw, fwd_bwd_units=u) for kw, u in settings for n in (64, 128)]
    figures: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    assert report.plot(records, tmp_path / "p.png")
    (fig,) = figures
    drawn = {
        (ax.get_title(), line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in fig.axes
        if ax.get_title().startswith("time, ")
        for line in ax.lines
        if line.get_label().endswith(" fwd+bwd")
    }
    cpu = "time, H=32, V=1000, fp32, T=0.7, CPU X (2 cores)"
    assert drawn == {
        (cpu, "torch [git_commit aaaaaaa] fwd+bwd"): ([64, 128], [2.0, 2.0]),
        (cpu, "torch [git_commit bbbbbbb] fwd+bwd"): ([64, 128], [5.0, 5.0]),
        ("time, H=32, V=1000, fp32, T=0.7, NVIDIA H100 80GB HBM3", "torch fwd+bwd"): (
            [64, 128],
            [3.0, 3.0],
        ),
        ("time, H=32, V=1000, fp32, T=1, CPU X (2 cores)", "torch fwd+bwd"): (
            [64, 128],
            [4.0, 4.0],
        ),
    }


def test_the_table_names_each_rows_device_reference_and_temperature_where_they_differ() -> None:
    """Before: the header named the first result's reference only ('against a float64
    reference') and no row said its device or temperature."""
    cpu = result(device="CPU X", reference="float64")
    gpu = result(device="NVIDIA H100 80GB HBM3", reference="float32", temperature=1.0)
    table = report.markdown([cpu, gpu])
    assert "against a float64 reference" not in table
    assert "against the reference named in each row" in table.splitlines()[1]
    rows = {r["device"]: r for r in table_rows(table)}
    cpu, gpu_name = "CPU X (2 cores)", "NVIDIA H100 80GB HBM3"
    assert set(rows) == {cpu, gpu_name}
    assert (rows[cpu]["reference"], rows[cpu]["T"]) == ("float64", "0.7")
    assert (rows[gpu_name]["reference"], rows[gpu_name]["T"]) == ("float32", "1")
    # One run's results differ in none of them: no such column, the reference in the header.
    single = report.markdown([result(64), result(128)])
    assert "against a float64 reference" in single
    assert set(table_rows(single)[0]).isdisjoint({"device", "reference", "T", "measured"})


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("temperature", "hot", "a finite number > 0"), ("seed", -1, "an integer >= 0")],
)
def test_results_whose_temperature_or_seed_the_report_cannot_read_are_refused_by_name(
    field: str, value: object, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table and the plot now tell results apart by temperature and seed: a value they
    cannot compare is refused when the results are read, naming it (exit 2, bad input)."""
    bad = result()
    bad["case"][field] = value
    out = tmp_path / "r.json"
    out.write_text(json.dumps([result(), bad]))
    assert cli.main(["bench", "--report-only", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "item 1 is not a result" in err and f"'case.{field}' is" in err and expected in err


def test_a_failure_to_make_the_table_is_the_bench_s_fault_not_bad_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a TypeError inside the report read 'fusedhead: error: ...' with exit 2, the
    status of a bad argument, though the results had passed their checks."""
    out = tmp_path / "r.json"
    out.write_text(json.dumps([result()]))

    def broken(records: object) -> str:
        raise TypeError("'<' not supported between instances of 'dict' and 'dict'")

    monkeypatch.setattr(report, "markdown", broken)
    assert cli.main(["bench", "--report-only", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "a fault of fusedhead bench, not of the results or the arguments" in err
    assert "an unexpected failure" in err


def test_the_run_object_records_the_grid_cases_and_implementations_it_ran(
    torch_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: the 'run' object, 'defaults filled in', held impl, case and dtype as null."""
    monkeypatch.setattr(peers, "default_specs", lambda heads=(): ["torch"])  # the default list
    out = tmp_path / "r.json"
    argv = ["bench", *SMALL, "--case", "logprobs", "topk05", "--no-memory", "--no-accuracy"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    runs = [r["run"] for r in json.loads(out.read_text())]
    assert all(run == runs[0] for run in runs) and len(runs) == 2
    run = runs[0]
    assert run["impl"] == ["torch"]
    assert run["case"] == ["logprobs", "topk5"]  # as the records name them
    assert run["dtype"] == ["fp32"]  # the CPU's default
    assert (run["n"], run["hidden"], run["vocab"], run["device"]) == ([64], [32], [1000], "cpu")
    assert None not in run.values()
