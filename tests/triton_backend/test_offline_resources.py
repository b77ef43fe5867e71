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
def test_two_per_sm_config_compiles_for_sm90_small_enough_to_share_an_sm(tmp_path: Path) -> None:
    import triton

    nvidia_bin = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not nvidia_bin.exists():
        pytest.skip(f"this triton install has no cuobjdump ({nvidia_bin})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--only", "two_per_sm_128x128,whole_tile", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    pair, whole = rows["two_per_sm_128x128"], rows["whole_tile"]
    threads = pair["config"]["num_warps"] * 32
    assert 0 < pair["registers"] <= 255 and pair["stack_bytes"] >= 0
    # what the config is for: two programs' registers and shared memory fit one SM (64 Ki
    # registers, 228 KiB of shared memory with 1 KiB reserved per program)
    assert 2 * pair["registers"] * threads <= 65536, pair
    assert 2 * (pair["shared_bytes"] + 1024) <= 228 * 1024, pair
    # the whole 128 x 256 tile with three stages takes more shared memory than one of the pair
    assert whole["shared_bytes"] > pair["shared_bytes"]
    assert "two_per_sm_128x128" in proc.stdout and "regs" in proc.stdout
