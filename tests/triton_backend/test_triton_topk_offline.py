"""tools/topk_offline.py compiles the top-k kernels for an H100/H200 without a GPU: the recompute
of the candidate tiles at the launcher's rows per program and the selections (of the logits and of the
tile maxima) at every k must keep their tiles in registers (no spill), and every variant must compile. It runs in its own
process: this session interprets Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedhead_triton.topk import RECOMPUTE_ROWS

TOOL = (
    Path(__file__).resolve().parents[2] / "plugins" / "triton_backend" / "tools" / "topk_offline.py"
)


@pytest.mark.slow
def test_the_topk_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
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
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    shipped = f"tiles_at_{RECOMPUTE_ROWS}rows"
    selects = {f"{s}_kp{kp}" for s in ("select", "select_tiles") for kp in (2, 32, 64)}
    assert set(rows) == {shipped, "tiles_at_128rows", *selects}
    for row in rows.values():
        assert 0 < row["registers"] <= 255, row
    for name in (shipped, *selects):
        assert rows[name]["stack_bytes"] == 0, rows[name]
    # What the recompute's rows per program are bounded for: 128 gathered rows spill.
    assert rows["tiles_at_128rows"]["stack_bytes"] > 0, rows["tiles_at_128rows"]
