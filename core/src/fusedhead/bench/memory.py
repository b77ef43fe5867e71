"""Peak extra memory of one forward + backward, as docs/design.md measures it.

GPU: ``max_memory_allocated`` during the step minus what was allocated before it (inputs and the
already-allocated ``.grad`` tensors), so it counts the workspace and the weight gradient the backward
returns before it is accumulated. CPU: the process's peak resident size (``VmHWM``, reset through
``/proc/self/clear_refs``) minus its resident size before the step, in a fresh subprocess per
measurement (``python -m fusedhead.bench.memory``) so earlier cases leave nothing behind; glibc is
told to return large blocks to the system at once so the resident size follows the live tensors.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

#: Environment of the CPU measuring subprocess: large allocations mmap'd and unmapped on free.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not found in /proc/self/status")


def cpu_peak_supported() -> bool:
    """Whether this system exposes a resettable peak RSS (Linux ``clear_refs``)."""
    try:
        _status_kib("VmHWM")
        return os.path.exists("/proc/self/clear_refs")
    except OSError:
        return False


def cpu_peak_extra_bytes(step: Callable[[], object]) -> int:
    """Peak resident bytes above the current ones while ``step()`` runs, in this process."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    step()
    peak = _status_kib("VmHWM")
    return max(0, peak - before) * 1024


def cuda_peak_extra_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak allocated bytes above those allocated before ``step()`` runs."""
    gc.collect()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def measure_in_subprocess(case: dict[str, Any], spec: str, *, timeout: float | None = None) -> int:
    """CPU peak extra bytes of ``spec`` on ``case``, measured in a fresh Python process."""
    env = {**os.environ, **MALLOC_ENV}
    payload = json.dumps({"case": case, "impl": spec})
    proc = subprocess.run(
        [sys.executable, "-m", "fusedhead.bench.measure", payload],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"memory subprocess failed (exit {proc.returncode}): " + " | ".join(tail)
        )
    last = proc.stdout.strip().splitlines()[-1]
    return int(json.loads(last)["peak_extra_bytes"])
