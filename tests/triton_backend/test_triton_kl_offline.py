"""tools/kl_offline.py compiles the KL kernels for an H100/H200 without a GPU: both layouts'
kernels (``kl.KL_TILE``) must compile for sm_90a and fit one SM's shared memory, the dual tile
with both heads' accumulators in registers (no spill). It runs in its own process: this session
interprets Triton."""

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
def test_the_kl_kernels_of_both_layouts_compile_for_sm90(tmp_path: Path) -> None:
    import triton

    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not nvidia_bin.exists():
        pytest.skip(f"this triton install has no cuobjdump ({nvidia_bin})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kl_resources.json"
    names = "shipped,dual128,single256,dual128+block_n=256"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--only", names, "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        assert "error" not in row, row
        by_name.setdefault(row["name"], []).append(row)
    assert set(by_name) == set(names.split(","))
    for name in ("shipped", "dual128", "single256"):
        assert {(r["kernel"], r["reverse"]) for r in by_name[name]} == {
            ("stats", False), ("stats", True), ("dz", False), ("dz", True),
        }  # fmt: skip
        for row in by_name[name]:
            assert 0 < row["registers"] <= 255, row
            assert 0 < row["shared_bytes"] <= 227 * 1024, row  # one H100/H200 program's maximum
    # both heads' 128 x 128 accumulators fit in registers; two 128 x 256 ones do not
    assert all(r["stack_bytes"] == 0 for r in by_name["dual128"])
    assert all(r["stack_bytes"] > 0 for r in by_name["dual128+block_n=256"])
