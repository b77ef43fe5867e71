"""Spawned ranks for the multi-process tests: run them, fail with every rank's log, never hang."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def run_ranks(
    worker: Callable[..., None], args: tuple[Any, ...], world: int, logs: Path, what: str,
    timeout_s: float,
) -> None:  # fmt: skip
    """``worker(rank, *args)`` on ``world`` spawned processes; fails with every rank's log
    (``logs/rank*.log``) when one fails, and as a hang past ``timeout_s`` (ranks terminated)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail(f"{world} ranks did not finish {what} within {timeout_s} s")
    except Exception as exc:
        tails = "\n".join(
            f"--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(logs.glob("rank*.log"))
        )
        raise AssertionError(f"{exc}\n{tails}") from exc
