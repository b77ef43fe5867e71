"""Where and with what a measurement ran: its date, the device, the versions that matter and the
tree's git commit, recorded in every result."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path
from typing import Any

import torch

from fusedhead.bench.peers import dist_version

VERSIONED = (
    "fusedhead",
    "fusedhead-torch",
    "fusedhead-triton",
    "fusedhead-liger",
    "torch",
    "triton",
    "liger-kernel",
    "nvidia-cutlass-dsl",
    "cut-cross-entropy",
)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(device),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "memory_gib": round(props.total_memory / float(1 << 30), 1),
            "cuda": torch.version.cuda,
        }
    return {
        "type": "cpu",
        "name": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def versions() -> dict[str, str | None]:
    """Versions of Python and the distributions that matter, and fusedhead's git commit if run
    from a checkout."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    out.update({name: dist_version(name) for name in VERSIONED})
    out["git_commit"] = _git_commit()
    return out


#: Names the tree a run measured where the checkout's own ``.git`` cannot be trusted (a GPU
#: machine that receives the files but an older copy of ``.git``): set by scripts/gpu/*.sh from
#: the ``.gpu-stamp`` file that scripts/gpu/stamp.sh writes before the call.
GIT_COMMIT_ENV = "FUSEDHEAD_GIT_COMMIT"


#: The longest ``$FUSEDHEAD_GIT_COMMIT`` taken (a full SHA-256 commit and ``+dirty`` fit).
GIT_COMMIT_MAX = 80


def _checked_commit(value: str) -> str:
    """``value`` of ``$FUSEDHEAD_GIT_COMMIT`` if it is one line of printable ASCII of at most
    ``GIT_COMMIT_MAX`` characters, else a ValueError naming the variable: the records, the table
    and its Markdown file carry it (a second line would break the table, a byte that is not
    UTF-8 would fail the file's write after the run)."""
    if len(value) <= GIT_COMMIT_MAX and all(" " <= c <= "~" for c in value):
        return value
    shown = ascii(value if len(value) <= 60 else value[:60] + "...")
    wrong = [f"{len(value)} characters"] if len(value) > GIT_COMMIT_MAX else []
    wrong += [] if value.isascii() else ["a character that is not ASCII"]
    control = any(c.isascii() and not " " <= c <= "~" for c in value)
    wrong += ["a line break or another control character"] if control else []
    raise ValueError(
        f"{GIT_COMMIT_ENV}={shown}: expected one line of printable ASCII of at most "
        f"{GIT_COMMIT_MAX} characters, the commit the run measures (e.g. abc1234+dirty); "
        f"it has {' and '.join(wrong)}"
    )


def _git_commit() -> str | None:
    """``$FUSEDHEAD_GIT_COMMIT`` if set, else the short commit of the fusedhead checkout this
    package runs from (``+dirty`` with changes to its code, ``core/`` or ``plugins/``); None for
    an installed wheel. Never the repository of the current directory, which may be any
    project's."""
    import subprocess

    stamped = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if stamped:
        return _checked_commit(stamped)
    package = Path(__file__).resolve().parents[1]  # .../core/src/fusedhead in a checkout

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10
        )

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0:
            return None
        if Path(top.stdout.strip()).resolve() / "core" / "src" / "fusedhead" != package:
            return None  # installed inside some other repository (a venv in a project)
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        # the measured code only: a results file the bench rewrites (docs/bench/cpu.json) must
        # not mark the next appended run of the same code as another tree
        code = [":(top)core", ":(top)plugins"]
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *code).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")
