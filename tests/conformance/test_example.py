"""The third-party example passes the kit after ``pip install examples/third_party_backend``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fusedhead import registry
from fusedhead.testing import Outcome, check
from fusedhead.testing.outputs import OUTPUT_PROPERTIES
from fusedhead.testing.policy import POLICY_PROPERTIES


def test_example_is_discovered_through_its_entry_point(with_example):
    cand = registry.find("example-bi")
    assert cand.distribution == "fusedhead-example-batchinvariant"
    assert cand.value == "fusedhead_example_bi:BatchInvariantBackend"


def test_example_passes_the_kit_including_batch_invariance(with_example):
    results = {r.name: r for r in check("example-bi")}
    assert not [r.line() for r in results.values() if r.outcome is Outcome.FAIL]
    assert results["batch_invariance"].outcome is Outcome.PASS
    assert results["determinism"].outcome is Outcome.PASS
    not_run = {name for name, r in results.items() if r.outcome is Outcome.NOT_RUN}
    assert not_run == {
        "per_token_temperature",
        "softcap",
        "vocab_parallel",
        *OUTPUT_PROPERTIES,
        *POLICY_PROPERTIES,
    }


@pytest.mark.slow
def test_example_passes_in_half_precision_too(with_example):
    for dtype in ("fp16", "bf16"):
        results = check(
            "example-bi",
            dtype=dtype,
            properties=["forward_accuracy", "backward_accuracy", "batch_invariance"],
        )
        assert all(r.outcome is Outcome.PASS for r in results), [r.line() for r in results]


def test_third_party_pytest_command(with_example, tmp_path):
    """The command the example's README gives for CI: one test per property, not-run ones skipped."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "fusedhead.testing.plugin",
            "--fusedhead-backend",
            "example-bi",
            "--pyargs",
            "fusedhead.testing.suite",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-k",
            "forward_accuracy or ignore_index or batch_invariance or softcap",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed, 1 skipped" in proc.stdout, proc.stdout
    assert "does not declare softcap" in proc.stdout


def test_pytest_suite_fails_a_wrong_backend_on_its_property(tmp_path):
    """The pytest form reports a failure as a failed test named after the property."""
    import os
    from pathlib import Path

    here = Path(__file__).parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "kit_backends",
            "-p",
            "fusedhead.testing.plugin",
            "--fusedhead-backend",
            "wrong-ignored-rows",
            "--pyargs",
            "fusedhead.testing.suite",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "ignore_index or tiny_batches",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "test_property[ignore_index]" in proc.stdout
    assert "ignored rows must be exactly 0" in proc.stdout


def test_the_pytest_plugin_takes_the_devices_the_cli_takes(tmp_path):
    """Before: ``--fusedhead-device cuda:1`` was "invalid choice (choose from 'cpu', 'cuda')",
    where ``fusedhead check --device cuda:1`` runs; a device that is no torch device is refused."""
    command = [sys.executable, "-m", "pytest", "-p", "fusedhead.testing.plugin"]
    command += ["--fusedhead-backend", "torch", "--pyargs", "fusedhead.testing.suite", "-q"]
    command += ["-p", "no:cacheprovider", "-k", "tiny_batches", "--fusedhead-device"]
    indexed = subprocess.run(
        [*command, "cuda:1"], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    out = indexed.stdout + indexed.stderr
    assert "invalid choice" not in out, out
    assert indexed.returncode == 0 or "cannot be checked here" in out, out
    bad = subprocess.run(
        [*command, "tpu0"], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert bad.returncode == 4, bad.stdout + bad.stderr  # pytest's usage error
    assert "must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got 'tpu0'" in bad.stderr
