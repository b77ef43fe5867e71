"""The GPU check script's own logic, exercised on the CPU with the fallback on a small problem.

The lead runs it once on an H200; this makes sure that one run does not die on a bug.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "plugins" / "liger_backend" / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(TOOL.parent))
    try:
        import gpu_check as module
    finally:
        sys.path.remove(str(TOOL.parent))
    return module


def test_dry_run_writes_a_passing_report(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "report.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    s = report["sections"]
    assert report["passed"] is True
    assert s["describe"]["implementation"] == "fallback" and s["describe"]["would_run"] == "yes"
    assert s["bitwise"]["equal"] == {"log_probs": True, "entropy": True, "dh": True, "dw": True}
    assert "dispatches to _FusedLinearPPOFallbackFunction" in s["bitwise"]["direct"]
    for scale in ("s=1", "s=4"):
        assert s["accuracy"][scale]["log_probs"]["rel"] < 1e-6
        assert s["accuracy"][scale]["dh"]["rel"] < 1e-5
    assert set(s["timing"]["median_ms"]) >= {
        "gemm",
        "adapter_fwd",
        "direct_fwd",
        "adapter_fwd_bwd",
        "direct_fwd_bwd",
    }
    assert s["timing"]["ok"] is None  # no 3 % verdict from CPU wall-clock times
    assert s["memory"]["skipped"] == "CUDA only"
    assert all("error" not in entry for entry in s.values())


def test_a_failing_section_is_recorded_and_the_rest_still_runs(gpu_check, tmp_path: Path) -> None:
    args = gpu_check.parse_args([str(tmp_path / "r.json"), "--dry-run"])
    report = gpu_check.Report(args.out, args)
    with report.section("boom") as e:
        raise ValueError("kaboom")
    with report.section("after") as e:
        e["ok"] = True
    data = json.loads(args.out.read_text())
    assert data["sections"]["boom"]["ok"] is False and "kaboom" in data["sections"]["boom"]["error"]
    assert data["sections"]["after"]["ok"] is True


def test_fp32_refused_section_logic_on_cpu(gpu_check) -> None:
    args = gpu_check.parse_args(["unused.json", "--dry-run"])
    entry: dict = {}
    gpu_check.fp32_refused_section(entry, args, torch.device("cpu"))
    assert entry["ok"] is True and "BackendUnavailableError" in entry["adapter_error"]
    assert entry["liger_direct"].startswith("ran")  # Liger silently dispatches to its fallback


def test_same_bits_tells_signed_zeros_and_nans_apart(gpu_check) -> None:
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert gpu_check.same_bits(a, a.clone())
    assert not gpu_check.same_bits(a, torch.tensor([-0.0, float("nan"), 1.0]))
    assert gpu_check.same_bits(a.bfloat16(), a.bfloat16())
    assert not gpu_check.same_bits(a, a.double())
