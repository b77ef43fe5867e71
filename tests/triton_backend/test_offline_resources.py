"""tools/offline_resources.py compiles the dh kernel for an H100/H200 without a GPU and reads its
resource usage: the numbers a tuning round starts from (docs/benchmarks.md). It runs in its own
process: Triton fixes compiled-or-interpreted when it is imported, and this session interprets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = (
    Path(__file__).resolve().parents[2]
    / "plugins"
    / "triton_backend"
    / "tools"
    / "offline_resources.py"
)


@pytest.mark.slow
def test_dh_and_dz_kernels_compile_for_sm90_and_report_resources(tmp_path: Path) -> None:
    import triton

    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not nvidia_bin.exists():
        pytest.skip(f"this triton install has no cuobjdump ({nvidia_bin})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--only", "dh_fp24,dh_128x128_fp24,dz", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dh_fp24", "dh_128x128_fp24", "dz"}
    for row in rows.values():
        assert 0 < row["registers"] <= 255 and row["stack_bytes"] >= 0
        assert 0 < row["shared_bytes"] <= 228 * 1024  # one H100/H200 SM's shared memory
    # a 128 x 128 tile takes less shared memory than the shipped 128 x 256 one
    assert rows["dh_128x128_fp24"]["shared_bytes"] < rows["dh_fp24"]["shared_bytes"]
    assert "dh_fp24" in proc.stdout and "regs" in proc.stdout
