"""``fusedhead bench`` and ``fusedhead demo`` on tiny CPU problems: what they write and check."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fusedhead import cli
from fusedhead.bench import accuracy, memory, peers, timing
from fusedhead.bench.cases import IGNORE_INDEX, Case, make_inputs

#: A tiny problem but its N: a list flag given again adds to its list, so a test of other Ns
#: starts from this.
SHAPE = ["--device", "cpu", "--hidden", "16", "--vocab", "300", "--reps", "1"]
TINY = [*SHAPE, "--n", "48"]
OUTPUTS = ("log_probs", "entropy", "grad_hidden", "grad_weight")


@pytest.fixture
def torch_backend() -> None:
    pytest.importorskip("fusedhead_torch", reason="needs fusedhead-torch installed")


def test_demo_runs_the_torch_backend_and_passes(
    torch_backend: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(
        ["demo", "--n", "96", "--hidden", "32", "--vocab", "500", "--reps", "1", "--no-memory"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS: backend 'torch'" in out
    for label in ("log-probs", "entropy", "grad hidden", "grad weight", "full-logits reference"):
        assert label in out


def test_demo_model_without_the_integration_module_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fusedhead import demo

    monkeypatch.setattr(demo, "MODEL_MODULE", "fusedhead.integrations.no_such_module")
    assert cli.main(["demo", "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusedhead: error: ") and "not available" in err


def test_demo_tolerances_widen_only_for_coarser_declared_precisions() -> None:
    """As the kit's: log-probs from logits held in bf16 (torch's fp32_logits=False, liger's
    fallback) may be off by 2 u of bf16, and so may an entropy held in, or computed from, bf16."""
    from fusedhead.demo import TOLERANCES, tolerances

    assert tolerances("fp32", "fp32", "fp32") == TOLERANCES["fp32"]
    assert tolerances("bf16", "fp32", "fp32") == TOLERANCES["bf16"]
    assert tolerances("bf16", "fp32", "bf16")["entropy"] == pytest.approx(2 * 2.0**-8)
    assert tolerances("bf16", "fp32", "bf16")["log_probs"] == TOLERANCES["bf16"]["log_probs"]
    held_bf16 = tolerances("bf16", "bf16", "fp32")
    assert held_bf16["log_probs"] == held_bf16["entropy"] == pytest.approx(2 * 2.0**-8)
    assert held_bf16["grad"] == TOLERANCES["bf16"]["grad"]
    # never coarser than the inputs
    assert tolerances("fp32", "bf16", "bf16") == TOLERANCES["fp32"]


def test_demo_passes_a_backend_declaring_bf16_logits() -> None:
    """It failed on the torch backend's documented fp32_logits=False, at the full-logits
    reference's own error (3.2e-4 against a target of 3e-4), where ``fusedhead check`` passes."""
    from fusedhead.cli import main

    argv = ["demo", "--quiet", "--reps", "1", "--no-memory", "--dtype", "bf16", "--n", "64"]
    argv += ["--hidden", "32", "--vocab", "500", "--options", '{"fp32_logits": false}']
    assert main(argv) == 0


def test_bench_writes_one_json_object_per_measurement(torch_backend: None, tmp_path: Path) -> None:
    out, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    rc = cli.main(
        [
            "bench",
            *SHAPE,
            "--n",
            "32",
            "64",
            "--impl",
            "torch",
            "reference",
            "liger-direct",
            "--no-memory",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    records = json.loads(out.read_text())
    assert [(r["case"]["n"], r["impl"]) for r in records] == [
        (n, name) for n in (32, 64) for name in ("torch", "reference", "liger-direct")
    ]
    for r in records:
        for key in ("case", "impl", "kind", "status", "date", "device", "versions"):
            assert key in r, key
        assert r["device"]["type"] == "cpu"
        assert r["versions"]["torch"] == torch.__version__.split("+")[0] or r["versions"]["torch"]
        assert r["case"]["dtype"] == "fp32" and r["case"]["temperature"] == 0.7
        # how the run was asked for, defaults filled in
        assert r["run"]["reps"] == 1 and r["run"]["n"] == [32, 64] and r["run"]["no_memory"]
        assert r["run"]["max_minutes"] == 10.0 and r["run"]["seed"] == 0
    ok = [r for r in records if r["status"] == "ok"]
    assert {r["impl"] for r in ok} == {"torch", "reference"}
    for r in ok:
        assert r["reference_dtype"] == "float64"
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["fwd_bwd_units"] == pytest.approx(r["fwd_bwd_ms"] / r["unit_ms"], rel=0.5)
        for name in OUTPUTS:
            assert r["errors"][name]["rel"] < 1e-5, (r["impl"], name, r["errors"][name])
            assert r["errors"][name]["max_abs"] < 1e-4
    skipped = [r for r in records if r["status"] == "skipped"]
    assert all("SM90" in r["reason"] for r in skipped)
    table = md.read_text()
    assert (
        "| implementation |" in table and "| torch |" in table and "liger-direct: skipped" in table
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" or pytest.importorskip("matplotlib") is None


def test_bench_json_is_valid_after_every_case(tmp_path: Path) -> None:
    from fusedhead.bench.results_file import JsonWriter

    path = tmp_path / "r.json"
    writer = JsonWriter(path)
    assert json.loads(path.read_text()) == []
    writer.add({"impl": "a", "x": math.nan})
    writer.add({"impl": "b"})
    assert [r["impl"] for r in json.loads(path.read_text())] == ["a", "b"]


def test_unknown_implementation_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *TINY, "--impl", "verl-chunkd"]) == 2
    err = capsys.readouterr().err
    assert "unknown implementation 'verl-chunkd'" in err
    assert "reference, verl-chunked, liger-direct, cce" in err


def test_an_implementation_listed_twice_is_refused_before_any_work(
    torch_backend: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b.json"
    for twice in (["torch", "torch"], ["torch", "torch:{}"], ["reference", "reference"]):
        assert cli.main(["bench", *TINY, "--impl", *twice, "--json", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--impl {twice[0]!r} and {twice[1]!r} name the same implementation" in err
        assert not out.exists()


def test_bad_impl_options_are_errors() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        peers.resolve("torch:[1]")
    with pytest.raises(ValueError, match="takes no options"):
        peers.resolve('reference:{"a": 1}')


def test_time_cap_skips_what_remains(
    torch_backend: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    rc = cli.main(["bench", *TINY, "--impl", "torch", "--max-minutes", "1e-9", "--json", str(out)])
    [record] = json.loads(out.read_text())
    assert record["status"] == "skipped" and "time cap" in record["reason"]
    # nothing was measured: a run that measured nothing is not a success
    assert rc == 1 and "nothing was measured" in capsys.readouterr().out


def test_reference_is_skipped_where_its_logits_would_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    impl = peers.resolve("reference")
    case = Case(4096, 64, 50000)
    monkeypatch.setattr(peers, "_free_bytes", lambda device: 1 << 30)
    reason = impl.availability(case)
    assert reason is not None and "GiB" in reason
    monkeypatch.setattr(peers, "_free_bytes", lambda device: 1 << 40)
    assert impl.availability(case) is None


def test_gemm_units_divide_by_the_paired_gemm_time() -> None:
    """On the CPU each timed repetition is paired with a GEMM; units are the ratio's median."""
    work = lambda: time.sleep(0.03)  # noqa: E731
    gemm = lambda: time.sleep(0.01)  # noqa: E731
    t = timing.timed_units(work, torch.device("cpu"), reps=3, unit_ms=1.0, gemm=gemm)
    assert t["units"] == pytest.approx(3.0, rel=0.35)
    assert t["unit_ms"] == pytest.approx(10.0, rel=0.5)
    assert len(t["unit_samples"]) == 3  # the paired GEMMs' own times, for the spread
    fixed = timing.timed_units(work, torch.device("cpu"), reps=2, unit_ms=15.0)
    assert fixed["units"] == pytest.approx(fixed["ms"] / 15.0)
    assert timing.units(30.0, 10.0) == 3.0


def test_gpu_units_come_from_interleaved_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the GEMM window and the function's alternate, CUDA_ROUNDS times: a clock that
    drifts between windows moves both, and the units are the median of the per-round ratios."""
    calls: list[str] = []
    times = iter([10.0, 40.0, 12.0, 36.0, 11.0, 33.0, 9.0, 36.0])

    def fake(fn: object, device: torch.device, *, reps: int = 3) -> float:
        calls.append("gemm" if fn is gemm else "fn")
        return next(times)

    gemm, work = (lambda: None), (lambda: None)
    monkeypatch.setattr(timing, "median_ms", fake)
    monkeypatch.setattr(timing, "CUDA_ROUNDS", 4)
    t = timing.timed_units(work, torch.device("cuda"), reps=3, unit_ms=1.0, gemm=gemm)
    assert calls == ["gemm", "fn"] * 4
    assert t["units"] == pytest.approx(3.5)  # median of 4, 3, 3, 4
    assert t["ms"] == pytest.approx(36.0) and t["unit_ms"] == pytest.approx(10.5)
    assert t["unit_spread"] == pytest.approx(12.0 / 9.0)  # the slowest GEMM over the fastest
    assert timing.CUDA_WINDOW_MS >= 2000 and timing.CUDA_MIN_RUNS >= 8


def test_an_unsteady_gemm_unit_is_named_under_the_table() -> None:
    """A loaded CPU made a tiny paired GEMM 80x slower: units said the opposite of the ms."""
    from fusedhead.bench import report

    case = Case(64, 64, 1000).to_dict()
    row = {"status": "ok", "case": case, "fwd_bwd_ms": 6.6, "fwd_bwd_units": 78.0, "unit_ms": 0.08}
    records = [
        {**row, "impl": "steady", "unit_spread": 1.2},
        {**row, "impl": "loaded", "unit_spread": 80.0},
    ]
    text = report.markdown(records)
    assert "Unsteady GEMM unit" in text and "compare these rows in ms" in text
    listed = text.split("Unsteady GEMM unit")[1]
    assert (
        "loaded" in listed and "80.0x" in listed and "steady" not in listed.replace("Unsteady", "")
    )
    assert "Unsteady" not in report.markdown(records[:1])


def test_one_run_of_the_gemm_unit_is_named_as_unknown_steadiness() -> None:
    """With ``--reps 1`` and no forward timed, one paired GEMM is all there is: its spread is
    unknown (not 1.0), and the table says so."""
    from fusedhead.bench import report

    assert timing.unit_steadiness([8.0]) == {"unit_runs": 1, "unit_spread": None}
    assert timing.unit_steadiness([0.06, 8.0, 0.05]) == {"unit_runs": 3, "unit_spread": 160.0}
    case = Case(64, 64, 1000).to_dict()
    row = {"status": "ok", "case": case, "fwd_bwd_ms": 6.6, "fwd_bwd_units": 78.0, "unit_ms": 0.08}
    text = report.markdown([{**row, "impl": "once", **timing.unit_steadiness([8.0])}])
    assert "- N=64 H=64 V=1000 fp32 once: one run (raise --reps)" in text


def test_the_unit_spread_pools_the_forwards_and_the_steps_gemms(
    torch_backend: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One repetition each of the forward and the step: their two GEMMs make the spread."""
    gemm_times = iter([1.0, 4.0])
    real = timing.timed_units

    def one_gemm_each(*args: object, **kwargs: object) -> dict[str, object]:
        t = real(*args, **kwargs)  # type: ignore[arg-type]
        return {**t, "unit_samples": [next(gemm_times)]}

    monkeypatch.setattr(timing, "timed_units", one_gemm_each)
    out = tmp_path / "b.json"
    args = ["bench", *TINY, "--impl", "torch", "--json", str(out), "--no-memory"]
    assert cli.main(args) == 0
    (rec,) = [r for r in json.loads(out.read_text()) if r["status"] == "ok"]
    assert rec["unit_runs"] == 2 and rec["unit_spread"] == pytest.approx(4.0)


def test_gemm_unit_times_one_matmul_of_the_case() -> None:
    inputs = make_inputs(Case(64, 32, 256))
    assert timing.gemm_ms(inputs.hidden, inputs.weight, reps=2) > 0


@pytest.mark.skipif(not memory.cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_cpu_peak_memory_sees_an_allocation() -> None:
    """In a fresh process with the bench's glibc settings, as the bench measures: in a test
    worker that earlier tests have used, it once read 0 for the 64 MiB (CI, 2026-12-07)."""
    code = (
        "import torch; from fusedhead.bench import memory; "
        "print(memory.cpu_peak_extra_bytes("
        "lambda: torch.ones(16 << 20, dtype=torch.float32).sum()))"
    )
    env = {**os.environ, **memory.MALLOC_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    extra = int(proc.stdout.split()[-1])
    assert 60 << 20 <= extra < 100 << 20  # the 64 MiB tensor, and not much else


@pytest.mark.skipif(not memory.cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_reference_peak_memory_holds_its_full_logits() -> None:
    case = Case(512, 64, 4000)
    extra = memory.measure_in_subprocess(case.to_dict(), "reference", timeout=300)
    assert extra >= case.n * case.vocab * 4  # at least one fp32 [N, V] buffer


def test_inputs_follow_the_design() -> None:
    case = Case(1000, 64, 500, scale=4.0, seed=3)
    a, b = make_inputs(case), make_inputs(case)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.labels, b.labels)
    assert int((a.labels == IGNORE_INDEX).sum()) == 100
    assert float(a.weight.std()) == pytest.approx(4.0 / 8.0, rel=0.05)
    assert float(a.hidden.std()) == pytest.approx(1.0, rel=0.05)


def test_errors_are_relative_l2_and_max_abs_and_see_nan() -> None:
    b = torch.tensor([3.0, 4.0], dtype=torch.float64)
    e = accuracy.error(torch.tensor([3.0, 4.5]), b)
    assert e["rel"] == pytest.approx(0.5 / 5.0) and e["max_abs"] == pytest.approx(0.5)
    assert math.isnan(accuracy.error(torch.tensor([math.nan, 4.0]), b)["rel"])


def test_reference_gradients_without_entropy_are_the_log_prob_term() -> None:
    case = Case(40, 8, 50)
    inputs = make_inputs(case)
    ref = accuracy.compute_reference(case, inputs, lp_only_grads=True)
    h = inputs.hidden.double().requires_grad_(True)
    w = inputs.weight.double().requires_grad_(True)
    lp, _ = peers.full_logits(h, w, inputs.labels, case.temperature)
    torch.autograd.backward([lp], [inputs.grad_log_probs.double()])
    dh, dw = ref.grads(with_entropy=False)
    assert torch.allclose(dh, h.grad) and torch.allclose(dw, w.grad)


def test_a_backend_that_does_not_load_costs_only_its_own_rows(
    with_fixture_dists: Path, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    rc = cli.main(["bench", *TINY, "--impl", "broken", "dup", "reference", "--no-memory",
                   "--json", str(out)])  # fmt: skip
    assert rc == 1  # errors were recorded
    by_impl = {r["impl"]: r for r in json.loads(out.read_text())}
    assert by_impl["broken"]["status"] == "error" and "broken" in by_impl["broken"]["error"]
    assert by_impl["dup"]["status"] == "error" and "claimed by 2" in by_impl["dup"]["error"]
    assert by_impl["reference"]["status"] == "ok"


def test_an_installed_plugin_whose_name_cannot_be_selected_costs_only_its_row(
    tmp_path: Path, site_on_path: Callable[[Path], Path]
) -> None:
    """The default list holds every installed entry point: one named against the name rule
    aborted the whole run (exit 2) before anything was measured."""
    site = tmp_path / "site"
    info = site / "fakebad-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakebad\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fusedhead.backends]\nBad_Name = nosuchmod:X\n")
    site_on_path(site)
    out = tmp_path / "r.json"
    rc = cli.main(["bench", *TINY, "--no-memory", "--no-accuracy", "--json", str(out)])
    assert rc == 1  # an error was recorded, the rest measured
    by_impl = {r["impl"]: r for r in json.loads(out.read_text())}
    bad = by_impl["Bad_Name"]
    assert bad["status"] == "error" and "cannot be selected" in bad["error"]
    assert bad["error"].count("BackendLoadError") <= 1, bad["error"]  # its class named once
    assert by_impl["torch"]["status"] == "ok"


def test_report_only_rewrites_table_and_plot_from_json(tmp_path: Path) -> None:
    record = {
        "case": {"n": 8, "hidden": 4, "vocab": 10, "dtype": "bf16", "scale": 1.0},
        "impl": "x", "status": "ok", "fwd_units": 1.1, "fwd_bwd_units": 4.2, "unit_ms": 2.0,
        "fwd_bwd_ms": 8.4, "peak_extra_bytes": 1 << 30, "errors": None,
        "device": {"name": "GPU", "type": "cuda"}, "versions": {"torch": "2"}, "date": "2026",
    }  # fmt: skip
    src = tmp_path / "in.json"
    src.write_text(json.dumps([record]))
    md = tmp_path / "t.md"
    assert cli.main(["bench", "--report-only", "--json", str(src), "--markdown", str(md)]) == 0
    assert "| 8 | 4 | 10 | bf16 | x | 2.00 | 1.10 | 4.20 | 8.4 | 1 |" in md.read_text()


def test_a_terminated_bench_still_writes_its_table(tmp_path: Path) -> None:
    """``timeout`` sends SIGTERM: the results so far still reach the JSON and the Markdown table."""
    import signal
    import subprocess
    import sys

    out, md = tmp_path / "r.json", tmp_path / "r.md"
    cmd = [sys.executable, "-m", "fusedhead.cli", "bench", *SHAPE, "--n", *map(str, range(16, 400, 16)),
           "--impl", "reference", "--reps", "20", "--no-memory", "--json", str(out),
           "--markdown", str(md)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if out.exists() and json.loads(out.read_text() or "[]"):
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == 128 + signal.SIGTERM
    assert "| reference |" in md.read_text()


def test_git_commit_is_the_stamped_one_where_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU machine gets the files but an older .git: the stamp made here names the tree."""
    from fusedhead.bench import provenance

    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, "abc1234+dirty")
    assert provenance.versions()["git_commit"] == "abc1234+dirty"
    monkeypatch.setenv(provenance.GIT_COMMIT_ENV, "")
    assert provenance.versions()["git_commit"] != "abc1234+dirty"


def test_a_case_whose_inputs_cannot_be_made_is_recorded_and_the_run_goes_on(
    torch_backend: None, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    # V = 10**15 at H = 16: inputs of 64 PB, refused by the allocator; the V = 300 case still runs
    argv = ["bench", "--device", "cpu", "--n", "48", "--hidden", "16", "--vocab", "300"]
    argv += [str(10**15), "--reps", "1", "--no-memory", "--impl", "torch", "--json", str(out)]
    rc = cli.main(argv)
    records = {r["case"]["vocab"]: r for r in json.loads(out.read_text())}
    assert records[300]["status"] == "ok"
    bad = records[10**15]
    assert bad["status"] == "error" and "inputs, GEMM unit or reference failed" in bad["error"]
    assert rc == 1


def test_a_backend_that_does_not_run_on_the_device_gives_its_own_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels need a GPU then
    reason = peers.resolve("triton").availability(Case(48, 16, 300))
    assert reason is not None and "TRITON_INTERPRET=1" in reason, reason


def test_the_commit_is_fusedheads_not_the_current_directorys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import subprocess

    from fusedhead.bench import provenance

    monkeypatch.delenv(provenance.GIT_COMMIT_ENV, raising=False)
    other = tmp_path / "other-project"
    other.mkdir()
    git = ["git", "-c", "user.name=a", "-c", "user.email=a@b", "-C", str(other)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    theirs = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    monkeypatch.chdir(other)
    commit = provenance.versions()["git_commit"]
    assert commit is None or not commit.startswith(theirs.stdout.strip())
    root = Path(provenance.__file__).resolve().parents[4]
    if (root / ".git").exists():  # a checkout of fusedhead: its own commit
        ours = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        assert commit is not None and commit.split("+")[0] == ours.stdout.strip()


def test_the_table_header_names_every_tree_and_setting_it_shows() -> None:
    from fusedhead.bench import report

    def record(commit: str, env: dict[str, str], date: str) -> dict[str, object]:
        return {
            "case": {"n": 8, "hidden": 8, "vocab": 16, "dtype": "fp32"},
            "impl": "torch",
            "status": "ok",
            "date": date,
            "device": {"type": "cpu", "name": "X", "cores": 2},
            "versions": {"torch": "2.13.0", "git_commit": commit},
            "environment": env,
        }

    first = record("aaaaaaa", {}, "2026-12-02T10:00:00+00:00")
    later = record("bbbbbbb", {"TRITON_INTERPRET": "1"}, "2026-12-02T11:00:00+00:00")
    header = report.markdown([first, later]).splitlines()[0]
    assert "aaaaaaa / bbbbbbb" in header and "TRITON_INTERPRET=1" in header
    assert "2026-12-02T10:00:00+00:00 to 2026-12-02T11:00:00+00:00" in header
    assert "no reference was computed" in report.markdown([first]).splitlines()[1]


def test_a_row_whose_errors_failed_still_names_its_reference() -> None:
    """A float64 reference computed for a row whose gradients overflowed: the header named none."""
    from fusedhead.bench import report

    failed = {
        "case": {"n": 8, "hidden": 8, "vocab": 16, "dtype": "fp16"},
        "impl": "torch",
        "status": "error",
        "note": "NaN or inf in grad_hidden against the reference",
        "reference_dtype": "float64",
        "date": "2026-12-07T12:00:00+00:00",
        "device": {"type": "cpu", "name": "X", "cores": 2},
        "versions": {"torch": "2.13.0"},
        "environment": {},
    }
    header = report.markdown([failed]).splitlines()[1]
    assert "against a float64 reference" in header and "no reference" not in header


def test_only_changes_to_the_code_mark_the_commit_dirty(tmp_path: Path) -> None:
    """Before: a results file the bench rewrites (docs/bench/cpu.json, tracked) made every later
    appended run of the same code ``<sha>+dirty``, so ``--append`` split one series in two. Now
    ``+dirty`` means the measured code (core/, plugins/) differs from the commit."""
    import subprocess
    import sys

    from fusedhead.bench import provenance

    root = Path(provenance.__file__).resolve().parents[4]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout of fusedhead")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--shared", str(root), str(clone)], check=True)
    # the clone runs this checkout's provenance.py (committed there), not the last commit's
    mine = clone / "core" / "src" / "fusedhead" / "bench" / "provenance.py"
    mine.write_text(Path(provenance.__file__).read_text())
    git = ["git", "-c", "user.name=a", "-c", "user.email=a@b", "-C", str(clone)]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-am", "this checkout's"], check=True)
    env = {k: v for k, v in os.environ.items() if k != provenance.GIT_COMMIT_ENV}
    env["PYTHONPATH"] = str(clone / "core" / "src")
    ask = "from fusedhead.bench import provenance; print(provenance.versions()['git_commit'])"

    def commit() -> str:
        run = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    clean = commit()
    assert clean and "+" not in clean, clean
    (clone / "docs" / "bench" / "cpu.json").write_text("[]\n")
    assert commit() == clean  # the bench's own output is not the code
    with mine.open("a") as f:
        f.write("\n")
    assert commit() == clean + "+dirty"


def test_a_unit_slowed_alike_in_every_paired_run_is_named_under_the_table() -> None:
    """A loaded 2-core CPU made every paired 0.04 ms GEMM take 16 ms: their spread was 1.2x, so
    the table gave 2.02 units without a word. The GEMM timed alone before the case tells."""
    from fusedhead.bench import report

    case = Case(64, 32, 500).to_dict()
    row = {"status": "ok", "case": case, "fwd_bwd_ms": 32.0, "fwd_bwd_units": 2.02}
    records = [
        {**row, "impl": "fair", "unit_ms": 0.04, "gemm_ms": 0.037, "unit_spread": 1.2},
        {**row, "impl": "slowed", "unit_ms": 15.79, "gemm_ms": 0.037, "unit_spread": 1.22},
    ]
    listed = report.markdown(records).split("Unsteady GEMM unit")[1]
    assert "slowed: paired median 15.8 ms, alone 0.037 ms" in listed and "fair" not in listed


def test_the_provenance_line_names_the_settings_every_row_shares() -> None:
    """A run at T = 1.0 printed the same header as one at 0.7: the T column shows only where rows
    differ, and the line above the table named no setting."""
    from fusedhead.bench import report

    row = {"status": "ok", "impl": "torch", "fwd_bwd_ms": 1.0, "fwd_bwd_units": 4.0}
    runs = [
        {**row, "case": Case(64, 32, 500, temperature=t, seed=3).to_dict(), "run": {"reps": 5}}
        for t in (1.0, 0.7)
    ]
    assert "Settings: T 1, seed 3, reps 5." in report.markdown(runs[:1])
    assert "Settings: T 1 / 0.7, seed 3, reps 5." in report.markdown(runs)
