"""``fusedhead check NAME`` passes on the CPU for every first-party backend that is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fusedhead import registry
from fusedhead.testing.policy import POLICY_PROPERTIES


def fusedhead_check(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``fusedhead check ...`` the way a user does, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "fusedhead.cli", "check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def assert_passes(proc: subprocess.CompletedProcess[str]) -> None:
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [line for line in lines if line.startswith("FAIL ")]
    assert sum(line.startswith("PASS ") for line in lines) >= 12, proc.stdout


def installed(name: str) -> bool:
    """Whether a distribution providing backend ``name`` is installed in this environment."""
    return name in registry.candidates()


def needs(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not installed(name),
        reason=f"backend {name!r} is not installed here (pip install -e plugins/{name}_backend --no-deps)",
    )


@needs("torch")
def test_fusedhead_check_torch_passes_on_cpu():
    proc = fusedhead_check("torch")
    assert_passes(proc)
    assert "PASS vocab_parallel" in proc.stdout and "PASS determinism" in proc.stdout
    for prop in POLICY_PROPERTIES:  # torch declares policy_loss
        assert f"PASS {prop}" in proc.stdout, proc.stdout


@needs("torch")
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fusedhead_check_torch_passes_on_cpu_in_low_precision(dtype):
    assert_passes(fusedhead_check("torch", "--dtype", dtype))


@needs("liger")
@pytest.mark.slow
def test_fusedhead_check_liger_fallback_passes_on_cpu():
    assert_passes(fusedhead_check("liger", "--options", json.dumps({"implementation": "fallback"})))


@needs("triton")
def test_fusedhead_check_triton_runs_end_to_end_in_the_interpreter():
    """The command a user runs, on the cheap properties: every property of the kit runs on triton
    under the interpreter once, one test each, in tests/triton_backend/test_triton_kit.py."""
    cheap = "forward_accuracy,without_entropy,ignore_index,unchecked_labels,tiny_batches"
    proc = fusedhead_check("triton", "--dtype", "fp32", "-k", cheap, env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PASS ")}
    assert passed == set(cheap.split(",")), proc.stdout


@needs("liger")
def test_liger_native_on_cpu_is_an_error_with_the_reason():
    proc = fusedhead_check("liger", "-k", "forward_accuracy")
    assert proc.returncode == 2
    assert "cannot run on cpu" in proc.stderr and "fallback" in proc.stderr, proc.stderr
