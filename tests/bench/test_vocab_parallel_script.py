"""scripts/gpu/vocab_parallel_nccl.py (issue 9) and degree_nccl.py (issue 35) rehearsed on the
CPU: gloo, fp32, tiny shapes, Triton under the interpreter.

The scripts are run for real only on machines of several GPUs; here their plumbing is checked:
every rank times the same number of runs (a collective inside a timed step would otherwise hang),
each backend that declares vocab-parallel matches its single-process result on every layout it
declares, and one that does not is recorded with the reason; at degree 2 and 4 on the grid's
shards, log-probs and entropy are the one-process bits.
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


@pytest.mark.multiprocess
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


DEGREE_SCRIPT = ROOT / "scripts" / "gpu" / "degree_nccl.py"


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo on Linux")
def test_degree_rehearsal_gives_the_one_process_bits_at_degree_2_and_4(tmp_path: Path) -> None:
    """Issue 35's script on four gloo ranks: degree 2 (two groups side by side) and 4 on the
    grid's shards, torch and triton (interpreter), two row counts: log-probs and entropy bitwise
    equal to each rank's one-process call, gradients within the bound, every timing recorded."""
    pytest.importorskip("triton")
    out = tmp_path / "out"
    env = {**os.environ, "VP_REHEARSE": "1", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    for key in ("VP_DEGREES", "VP_BACKENDS", "VP_DEADLINE_S"):
        env.pop(key, None)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "4", str(DEGREE_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "every check passed" in proc.stdout
    for degree in (2, 4):
        doc = json.loads((out / f"degree{degree}.json").read_text())
        meta = doc["meta"]
        assert doc["done"] and not doc["skipped"]
        assert meta["degree"] == degree and meta["world"] == 4 and meta["grid"] == 1024
        assert len(meta["groups"]) == 4 // degree
        assert all(start % meta["grid"] == 0 for start, _ in meta["shards"])
        assert sum(rows for _, rows in meta["shards"]) == meta["shape"]["V"]
        cases = {(b, n) for b in ("torch", "triton") for n in meta["shape"]["N"]}
        for kind in ("checks", "timings"):
            recs = doc[kind]
            assert not [r for r in recs if "error" in r], [r["error"] for r in recs if "error" in r]
            assert sorted((r["backend"], r["N"], r["rank"]) for r in recs) == sorted(
                (b, n, rank) for b, n in cases for rank in range(4)
            )
        for r in doc["checks"]:
            assert r["bitwise"] == {"log_probs": True, "entropy": True}, r
            assert r["max_abs_diff"] == {"log_probs": 0.0, "entropy": 0.0}, r
            assert all(e <= r["grad_tol"] for e in r["grad_rel_l2"].values()), r
            assert r["pass"]
        for r in doc["timings"]:
            assert r["fwd_bwd_ms"] > 0 and r["gemm_unit_ms"] > 0
            assert r["single_gpu"]["fwd_bwd_ms"] > 0 and r["single_gpu"]["gemm_unit_ms"] > 0
            assert r["concurrent_groups"] == 4 // degree
            today, previous = r["combine"]["today"], r["combine"]["previous"]
            assert today["ms"] > 0 and previous["ms"] > 0
            # The combine timed is the one that gives the bits; the previous one is close only.
            assert set(today["max_abs_diff_vs_single_gpu"].values()) == {0.0}, r
            assert max(previous["max_abs_diff_vs_single_gpu"].values()) < 1e-4, r
            cross = r["combine"]["previous_cross_rank"]
            assert cross["max_abs_diff_vs_single_gpu"] == previous["max_abs_diff_vs_single_gpu"]
            assert isinstance(r["previous_combine_fwd_bwd_ms_est"], float)  # on the CPU: noise
