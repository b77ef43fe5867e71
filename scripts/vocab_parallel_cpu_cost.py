"""The torch backend's vocab-parallel combine on the CPU (gloo): its time against forward + backward.

    python scripts/vocab_parallel_cpu_cost.py [N H V]      (default 2048 1024 32768, fp32)

Degree 1 (one process, no group), then 2 and 4 (gloo ranks on the grid's shards). Each call is a
``fused_head`` forward + backward of log-probs and entropy; the combine (``combine_tiles``, or
``all_reduce_tile_stats`` with its two collectives under a group) is timed inside the calls by a
wrapper. Prints per degree: forward + backward ms (median of 5 after one warm-up), the combine's
ms and its fraction, and whether rank 0's log-probs and entropy are the one-process bits.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 5


def inputs(n: int, h: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::10] = -100
    return torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5, labels


def measure(shape: tuple[int, int, int], shard: tuple[int, int] | None, group: Any) -> dict:
    """Median fwd+bwd ms, the combine's ms inside it, and the outputs of the last call."""
    import fusedhead_torch.chunked as chunked
    from fusedhead import fused_head

    spent: list[float] = []

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent.append(time.perf_counter() - t0)
            return out

        return wrapper

    chunked.combine_tiles = timed(chunked.combine_tiles)  # type: ignore[attr-defined]
    chunked.all_reduce_tile_stats = timed(chunked.all_reduce_tile_stats)  # type: ignore[attr-defined]
    n, h, v = shape
    hidden, weight, labels = inputs(n, h, v)
    lo, rows = (0, v) if shard is None else shard
    kw = {} if group is None else {"process_group": group, "vocab_start": lo, "vocab_size": v}
    times, combine = [], []
    out = None
    for i in range(REPS + 1):
        x = hidden.clone().requires_grad_()
        w = weight[lo : lo + rows].clone().requires_grad_()
        spent.clear()
        t0 = time.perf_counter()
        out = fused_head(x, w, labels, backend="torch", **kw)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
            combine.append(sum(spent) * 1e3)
    assert out is not None
    return {
        "ms": statistics.median(times),
        "combine_ms": statistics.median(combine),
        "values": torch.stack([out.log_probs, out.entropy]).detach(),
    }


def worker(rank: int, world: int, port: int, shape: tuple[int, int, int], folder: str) -> None:
    from fusedhead.shards import grid_shards

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    res = measure(shape, grid_shards(shape[2], world, 1024)[rank], dist.group.WORLD)
    if rank == 0:
        torch.save(res, Path(folder) / f"degree{world}.pt")
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    shape = tuple(int(a) for a in sys.argv[1:4]) if len(sys.argv) == 4 else (2048, 1024, 32768)
    one = measure(shape, None, None)  # type: ignore[arg-type]
    print(f"N, H, V = {shape}, fp32, {torch.get_num_threads()} threads")
    print(f"degree 1: fwd+bwd {one['ms']:.1f} ms, combine {one['combine_ms']:.2f} ms "
          f"({one['combine_ms'] / one['ms']:.2%})")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for world in (2, 4):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            mp.spawn(worker, args=(world, port, shape, folder), nprocs=world, join=True)
            res = torch.load(Path(folder) / f"degree{world}.pt")
            same = torch.equal(res["values"], one["values"])
            print(f"degree {world}: fwd+bwd {res['ms']:.1f} ms per rank, combine with its "
                  f"collectives {res['combine_ms']:.2f} ms ({res['combine_ms'] / res['ms']:.2%}), "
                  f"one-process bits: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
