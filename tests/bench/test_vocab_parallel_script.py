"""scripts/gpu/vocab_parallel_nccl.py rehearsed on the CPU: gloo, fp32, a tiny shape.

The script is run for real only on a two-GPU machine; here its plumbing is checked: every
rank times the same number of runs (a collective inside a timed step would otherwise hang),
each backend that declares vocab-parallel matches its single-process result on every layout it
declares, and one that does not is recorded with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "vocab_parallel_nccl.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo on Linux")
def test_rehearsal_matches_single_process_on_every_layout(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    pytest.importorskip("liger_kernel")
    out = tmp_path / "vp.json"
    env = {**os.environ, "VP_REHEARSE": "1", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    by = {}
    for r in records:
        key = (r["backend"], r["options"].get("implementation"), r.get("layout"))
        by.setdefault(key, []).append(r)
    assert not [r for r in records if "error" in r], [r["error"] for r in records if "error" in r]
    for key in [("torch", None, "equal"), ("torch", None, "uneven"), ("triton", None, "equal"),
                ("triton", None, "uneven"), ("liger", "fallback", "equal")]:  # fmt: skip
        runs = by[key]
        assert sorted((r["rank"], r["reduce_hidden_grad"]) for r in runs) == [
            (0, False), (0, True), (1, False), (1, True)
        ], key  # fmt: skip
        assert all(r["pass"] for r in runs), [r["errors_vs_single_gpu"] for r in runs]
    native = by[("liger", "native", None)]
    assert {r["reason"] for r in native} == {"does not declare vocab_parallel"}
    assert {r["reason"] for r in by[("liger", "fallback", "uneven")]} == {
        "does not declare uneven_shards"
    }
    timed = [r for r in records if "fwd_bwd_ms" in r]
    assert timed and all(r["layout"] == "equal" and r["fwd_bwd_ms"] > 0 for r in timed)
