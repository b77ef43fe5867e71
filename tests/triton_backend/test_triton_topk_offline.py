"""tools/topk_offline.py compiles the top-k forward kernel for an H100/H200 without a GPU: the
shipped rows per program at k = 32 must keep the tile and the running set in registers (no
spill), and every k up to 64 must compile (its round loop is a while loop). It runs in its own
process: this session interprets Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedhead_triton.topk import BLOCK_M

TOOL = (
    Path(__file__).resolve().parents[2] / "plugins" / "triton_backend" / "tools" / "topk_offline.py"
)


@pytest.mark.slow
def test_the_topk_kernel_compiles_for_sm90_and_k32_does_not_spill(tmp_path: Path) -> None:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"this triton install has no cuobjdump ({tool})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "topk_resources.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["block_m"], r["kp"]) for r in rows} == {
        (m, k) for m in (BLOCK_M, 128) for k in (2, 32, 64)
    }
    for row in rows:
        assert 0 < row["registers"] <= 255, row
    shipped = [r for r in rows if r["block_m"] == BLOCK_M and r["kp"] == 32]
    assert shipped and shipped[0]["stack_bytes"] == 0, shipped
