"""examples/trainers/*.py: each runs offline on the CPU, exits 0 and prints both paths' figures.

Each script checks its own agreement (exit 1 past 1e-5 relative); here the printed table is read
as well, so a script that stopped comparing would fail. Skipped only where the trainer is not
installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trainers"

#: script -> (the trainer's module, the rows its table must print)
CASES = {
    "trl_grpo.py": ("trl", ("loss", "kl", "entropy")),
    "verl_fused_kernels.py": ("verl", ("log_probs", "entropy", "gradients")),
    "verl_fused_policy_loss.py": ("verl", ("actor/pg_loss", "actor/pg_clipfrac", "kl_loss")),
    "veomni_cross_entropy.py": ("veomni", ("loss", "log_probs", "entropy", "gradients")),
    "openrlhf_actor.py": ("openrlhf", ("log_probs", "entropy", "gradients")),
}


def test_every_trainer_has_an_example() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"tiny.py"}
    assert scripts == set(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs_offline_and_matches(script: str) -> None:
    module, rows = CASES[script]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (bash scripts/trainers/{module}.sh)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=EXAMPLES.parents[1],
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "fusedhead:torch" in done.stdout
    for row in rows:  # a table row: the name, the trainer's figure, fusedhead's, the difference
        found = re.findall(rf"^\s*(?:\d+\s+)?{row}\s+.*?([0-9.]+e[-+]\d+)\s*$", done.stdout, re.M)
        assert found, (row, done.stdout[-2000:])
        assert max(float(d) for d in found) <= 1e-5, (row, found)
