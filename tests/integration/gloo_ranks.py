"""Gloo CPU ranks for the vocab-parallel tests: spawn ``world`` processes that each run a worker
module's ``run(backend, rank)`` and save what it returned, then load every rank's result."""

from __future__ import annotations

import importlib
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(module: str, world: int, out: Path, backend: str) -> list[dict[str, Any]]:
    """Each rank's ``module.run(backend, rank)`` result, the ranks in one gloo group."""
    mp.spawn(_rank, args=(world, free_port(), str(out), module, backend), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _rank(rank: int, world: int, port: int, out: str, module: str, backend: str) -> None:
    """mp.spawn target: join the gloo group, run the worker module, save what it returned."""
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(  # a rank left waiting fails the test in a minute, not gloo's 30
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        result = importlib.import_module(module).run(backend, rank)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()
