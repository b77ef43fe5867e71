"""The README's ``fusedhead list`` transcript is what the command prints after scripts/setup.sh.

The transcript shows versions and reasons; when either changes (a release, a new message), this
test shows the fresh output to paste.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TRANSCRIPT = re.compile(r"```console\n(\$ fusedhead list\b.*?)```", re.S)
COMMAND = re.compile(r"^\$ (fusedhead list[^#\n]*?)\s*(?:#.*)?$")


def transcript() -> list[tuple[str, str]]:
    """(command, printed output) pairs of the README's list transcript."""
    found = TRANSCRIPT.search(README.read_text())
    assert found, "README.md has no ```console block starting with `$ fusedhead list`"
    pairs: list[tuple[str, list[str]]] = []
    for line in found.group(1).splitlines():
        cmd = COMMAND.match(line)
        if cmd:
            pairs.append((cmd.group(1), []))
        else:
            assert pairs, f"output before any command: {line!r}"
            pairs[-1][1].append(line)
    return [(cmd, "\n".join(lines)) for cmd, lines in pairs]


def printed(cmd: str) -> str:
    """The command's output in a plain shell of the dev venv (no test-only environment)."""
    exe = shutil.which("fusedhead", path=str(ROOT / ".venv" / "bin"))
    if exe is None:
        pytest.skip("no .venv/bin/fusedhead: run bash scripts/setup.sh")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "TRITON_INTERPRET"} and not k.startswith("FUSEDHEAD_")
    }
    proc = subprocess.run(
        [exe, *cmd.split()[1:]], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.rstrip("\n")


def test_the_transcript_has_both_commands() -> None:
    assert [cmd for cmd, _ in transcript()] == [
        "fusedhead list",
        "fusedhead list --check --device cpu",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the transcript is a CPU machine's")
def test_readme_list_transcript_is_what_list_prints() -> None:
    stale = []
    for cmd, shown in transcript():
        now = printed(cmd)
        if now != shown:
            stale.append(f"$ {cmd}\n{now}")
    assert not stale, "README.md's transcript is stale; paste the output of:\n" + "\n".join(stale)
