"""scripts/gpu/ab.sh rehearsed on the CPU: two committed trees packed, unpacked and timed in turn."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None
    or shutil.which("git") is None
    or not (ROOT / ".git").exists()
    or not sys.platform.startswith("linux"),
    reason="needs bash, git and a git checkout on Linux",
)


def _ab(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/gpu/ab.sh", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, **env},
    )  # fmt: skip


def test_each_tree_is_timed_in_its_own_process_round_by_round(tmp_path):
    env = {"AB_DIR": str(tmp_path / "packed"), "AB_ROOT": str(tmp_path / "trees"),
           "AB_DRY": "1", "PYTHON": sys.executable}  # fmt: skip
    packed = _ab("pack", "HEAD", env=env)
    assert packed.returncode == 0, packed.stderr
    (tgz,) = (tmp_path / "packed").glob("ab-*.tgz")
    shutil.copy(
        tgz, tgz.with_name("ab-other.tgz")
    )  # a second tree (a shallow clone has one commit)
    out = tmp_path / "out"
    run = _ab("run", str(out), "2", "plain,plain_check,fb_check,kl,kl_fb", env=env)
    assert run.returncode == 0, run.stderr + (out / "ab.err").read_text()
    rows = [json.loads(line) for line in (out / "ab.jsonl").read_text().splitlines()]
    tags = [r["tag"] for r in rows]
    assert len(rows) == 4 and tags[:2] == tags[2:] and tags[0] != tags[1]  # in turn, twice
    for row in rows:
        assert str(tmp_path / "trees" / row["tag"]) in row["src"]  # the tree's own code ran
        assert all(
            row[f"{c}_units"] > 0 for c in ("plain", "plain_check", "fb_check", "kl", "kl_fb")
        )


def test_run_without_packed_trees_says_what_to_do(tmp_path):
    run = _ab("run", str(tmp_path / "out"), env={"AB_DIR": str(tmp_path / "none")})
    assert run.returncode == 2 and "ab.sh pack REV" in run.stderr


def _python_stub(tmp_path, body: str) -> str:
    """A Python for ab.sh (PYTHON) that runs ``body`` (bash) first, then this interpreter."""
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\n{body}\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    return str(stub)


def _packed(tmp_path) -> dict[str, str]:
    env = {"AB_DIR": str(tmp_path / "packed"), "AB_ROOT": str(tmp_path / "trees"), "AB_DRY": "1",
           "WHEELS": str(tmp_path / "no-wheels")}  # fmt: skip
    packed = _ab("pack", "HEAD", env=env)
    assert packed.returncode == 0, packed.stderr
    return env


def test_run_stops_with_a_failure_when_the_install_fails(tmp_path):
    """Where fusedhead does not import, ab.sh installs one tree; that failing is a failure."""
    env = _packed(tmp_path)
    env["PYTHON"] = _python_stub(
        tmp_path,
        'if [[ "$1" == -c && "$2" == *"import fusedhead"* ]]; then exit 1; fi\n'
        'if [[ "$1" == -m && "$2" == pip ]]; then echo "stub pip: no index"; exit 1; fi',
    )
    out = tmp_path / "out"
    run = _ab("run", str(out), "1", "plain", env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "setup_tree: FAILED" in run.stderr
    assert not (out / "ab.jsonl").exists()  # nothing timed on whatever fusedhead was there


def test_run_exits_non_zero_when_a_trees_run_fails(tmp_path):
    env = _packed(tmp_path)
    env["PYTHON"] = _python_stub(
        tmp_path, 'if [[ "$1" == */ab_cases.py ]]; then echo "stub: failed" >&2; exit 3; fi'
    )
    out = tmp_path / "out"
    run = _ab("run", str(out), "1", "plain", env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "round 1: exit 3" in run.stderr
