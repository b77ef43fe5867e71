"""``fusedhead demo --model``: the transformers helper end to end on a tiny random model."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_cli_demo_tiny_llama_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fusedhead.cli", "demo", "--model", "tiny-llama"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LlamaForCausalLM" in proc.stdout and "PASS" in proc.stdout
    assert "per sample" in proc.stdout  # the torch backend takes a per-sample temperature


def test_unknown_model_cannot_run() -> None:
    """An unknown model is a ValueError naming it and the choices (the CLI's one error line on
    stderr, exit 2: tests/core/test_cli_errors.py), never a run."""
    from fusedhead.integrations.demo_model import run

    args = argparse.Namespace(
        model="tiny-nope", backend="torch", device="cpu", dtype="fp32", options=None
    )
    with pytest.raises(ValueError, match=r"demo --model tiny-nope: unknown demo model 'tiny-nope'"):
        run(args)


@pytest.mark.parametrize("device", ["meta", "cpux"])
def test_a_device_the_demo_cannot_run_on_is_refused_by_name(device: str) -> None:
    """As the synthetic demo refuses it: the CLI's one error line, exit 2 (before: meta crashed
    copying a meta tensor, exit 1, as a FAIL would)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusedhead.cli",
            "demo",
            "--model",
            "tiny-llama",
            "--device",
            device,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("fusedhead: error: "), proc.stderr
    assert "--device" in proc.stderr and repr(device) in proc.stderr
