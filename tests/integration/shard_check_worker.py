"""Worker for the shard-union tests: each gloo rank calls a backend on shards that leave part of
``vocab_size`` uncovered (or overlap, or disagree on it), and records what each call raised."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

N, H = 12, 16
WORLD = 2
#: name -> per rank (vocab_start, local rows, vocab_size), and call keywords.
CASES: dict[str, dict[str, Any]] = {
    "covered": {"shards": [(0, 8, 16), (8, 8, 16)], "kwargs": {}},
    "covered_uneven": {"shards": [(0, 5, 16), (5, 11, 16)], "kwargs": {"return_lse": True}},
    "gap_at_the_end": {"shards": [(0, 8, 20), (8, 8, 20)], "kwargs": {}},
    "gap_in_the_middle": {"shards": [(0, 8, 18), (10, 8, 18)], "kwargs": {}},
    "gap_with_extras": {"shards": [(0, 8, 20), (8, 8, 20)], "kwargs": {"return_lse": True}},
    "overlap": {"shards": [(0, 10, 18), (8, 10, 18)], "kwargs": {}},
    "sizes_differ": {"shards": [(0, 8, 16), (8, 8, 18)], "kwargs": {}},
    "covered_again": {"shards": [(0, 8, 16), (8, 8, 16)], "kwargs": {}},
}


def run(backend: str, options: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fusedhead import fused_head

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(20, H, generator=g) / 4  # enough rows for every case's shard
    labels = torch.randint(0, 16, (N,), generator=g)
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        start, width, size = case["shards"][rank]
        try:
            out = fused_head(
                hidden, weight[start : start + width].contiguous(), labels, backend=backend,
                options=options, process_group=dist.group.WORLD, vocab_start=start,
                vocab_size=size, **case["kwargs"],
            )  # fmt: skip
            results[name] = ("ok", out.log_probs.clone())
        except Exception as exc:  # what each rank raised, to compare across ranks
            results[name] = (type(exc).__name__, str(exc))
    return results


def worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    """mp.spawn target: join the gloo group, run every case, save what happened."""
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        options = {"block_m": 16, "block_n": 16, "block_k": 16} if backend == "triton" else {}
        torch.save(run(backend, options, rank), Path(out) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()
