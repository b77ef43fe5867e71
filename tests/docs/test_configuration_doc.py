"""docs/configuration.md is generated from the models: it must say what the code says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_matches_the_models() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (
        "docs/configuration.md is out of date with FusedHeadConfig or a backend's Options: "
        f"run python scripts/gen_config_docs.py\n{proc.stderr}"
    )
