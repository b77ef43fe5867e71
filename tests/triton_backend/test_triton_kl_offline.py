"""tools/kl_offline.py compiles the KL kernels for an H100/H200 without a GPU: the shipped KL tile
must compile for sm_90a with both heads' accumulators in registers (no spill) and fit one SM's
shared memory. It runs in its own process: this session interprets Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = (
    Path(__file__).resolve().parents[2] / "plugins" / "triton_backend" / "tools" / "kl_offline.py"
)


@pytest.mark.slow
def test_the_shipped_kl_kernels_compile_for_sm90_without_spilling(tmp_path: Path) -> None:
    import triton

    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not nvidia_bin.exists():
        pytest.skip(f"this triton install has no cuobjdump ({nvidia_bin})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kl_resources.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--only", "shipped,block_n=256", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r for r in rows), rows
    shipped = [r for r in rows if r["name"] == "shipped"]
    assert {(r["kernel"], r["reverse"]) for r in shipped} == {
        ("stats", False), ("stats", True), ("dz", False), ("dz", True),
    }  # fmt: skip
    for row in shipped:
        assert 0 < row["registers"] <= 255 and row["stack_bytes"] == 0, row
        assert 0 < row["shared_bytes"] <= 227 * 1024, row  # one H100/H200 program's maximum
    # why the KL tile is 128 wide: two 128 x 256 fp32 accumulators do not fit in registers
    wide = [r for r in rows if r["name"] == "block_n=256"]
    assert wide and all(r["stack_bytes"] > 0 for r in wide)
