"""One rank of the torch backend's vocab-parallel check, started by ``torch.multiprocessing.spawn``.

Every rank builds the same full problem from a seed, keeps its shard ``[start, stop)`` of the
weight for each case, runs the ``torch`` backend over gloo and saves its outputs and gradients for
the test to compare with one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fusedhead.protocol import call_backend

N, H, V = 64, 16, 120
IGNORE = -100
BAD_ROW = 5  # gets a label >= V: NaN on every rank, never a crash
NAN_ROW = 9  # an ignored row (labels[::9]) whose hidden state is NaN in the "nan-*" cases
OPTIONS = {"chunk_rows": 25, "block_vocab": 16}

#: name -> shard boundaries per world size, reduce_hidden_grad, extra forward arguments.
CASES: dict[str, dict[str, Any]] = {
    "equal": {"bounds": {2: [0, 60, 120], 3: [0, 40, 80, 120]}, "reduce": True},
    "equal-partial-dh": {"bounds": {2: [0, 60, 120], 3: [0, 40, 80, 120]}, "reduce": False},
    "uneven": {"bounds": {2: [0, 17, 120], 3: [0, 70, 71, 120]}, "reduce": True},
    "uneven-partial-dh": {"bounds": {2: [0, 17, 120], 3: [0, 70, 71, 120]}, "reduce": False},
    "empty-shard": {"bounds": {2: [0, 0, 120], 3: [0, 50, 50, 120]}, "reduce": True},
    "per-token-T-softcap": {
        "bounds": {2: [0, 45, 120], 3: [0, 20, 90, 120]},
        "reduce": True,
        "kwargs": {"softcap": 2.0, "per_token": True},
    },
    "all-rows-computed": {
        "bounds": {2: [0, 17, 120], 3: [0, 70, 71, 120]},
        "reduce": False,
        "kwargs": {"skip_ignored_rows": False},
    },
    "no-entropy": {
        "bounds": {2: [0, 60, 120], 3: [0, 40, 80, 120]},
        "reduce": True,
        "kwargs": {"return_entropy": False},
    },
    "nan-ignored-row": {
        "bounds": {2: [0, 17, 120], 3: [0, 70, 71, 120]},
        "reduce": True,
        "kwargs": {"nan_row": True},
    },
    "nan-ignored-row-all-rows": {
        "bounds": {2: [0, 60, 120], 3: [0, 0, 80, 120]},
        "reduce": True,
        "kwargs": {"nan_row": True, "skip_ignored_rows": False, "per_token": True},
    },
    "nan-ignored-row-no-entropy": {
        "bounds": {2: [0, 60, 120], 3: [0, 40, 80, 120]},
        "reduce": False,
        "kwargs": {"nan_row": True, "skip_ignored_rows": False, "return_entropy": False},
    },
}


def full_inputs() -> dict[str, torch.Tensor]:
    """The unsharded problem, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::9] = IGNORE
    labels[BAD_ROW] = V + 7
    return {
        "hidden": torch.randn(N, H, generator=gen),
        "weight": torch.randn(V, H, generator=gen) * (3.0 / H**0.5),
        "labels": labels,
        "temperature": torch.rand(N, generator=gen) * 2 + 0.2,
        "g_lp": torch.randn(N, generator=gen),
        "g_ent": torch.randn(N, generator=gen),
    }


def run_case(
    x: dict[str, torch.Tensor], start: int, stop: int, reduce: bool, group: Any, **kwargs: Any
) -> dict[str, torch.Tensor | None]:
    """Forward and backward of one shard (or of the full weight when ``group`` is None)."""
    from fusedhead_torch import TorchBackend, TorchOptions

    per_token = kwargs.pop("per_token", False)
    return_entropy = kwargs.pop("return_entropy", True)
    options = TorchOptions(**OPTIONS, skip_ignored_rows=kwargs.pop("skip_ignored_rows", None))
    h = x["hidden"].clone()
    if kwargs.pop("nan_row", False):
        assert x["labels"][NAN_ROW] == IGNORE
        h[NAN_ROW] = float("nan")
    h.requires_grad_()
    w = x["weight"][start:stop].clone().requires_grad_()
    lp, ent = call_backend(
        TorchBackend(options),
        h,
        w,
        x["labels"],
        temperature=x["temperature"] if per_token else 0.7,
        ignore_index=IGNORE,
        return_entropy=return_entropy,
        process_group=group,
        vocab_start=start,
        vocab_size=V,
        reduce_hidden_grad=reduce,
        **kwargs,
    )
    loss = (lp * x["g_lp"]).nansum()  # the out-of-range row is NaN: the caller skips it
    if ent is not None:
        loss = loss + (ent * x["g_ent"]).sum()
    loss.backward()
    return {
        "log_probs": lp.detach(),
        "entropy": None if ent is None else ent.detach(),
        "d_hidden": h.grad,
        "d_weight": w.grad,
    }


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of one spawned rank: every case, results to ``out_dir/rank{rank}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        x = full_inputs()
        results = {}
        for name, case in CASES.items():
            bounds = case["bounds"][world]
            results[name] = run_case(
                x,
                bounds[rank],
                bounds[rank + 1],
                case["reduce"],
                dist.group.WORLD,
                **dict(case.get("kwargs", {})),
            )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.barrier()  # gloo can abort a process torn down while a peer still talks
        dist.destroy_process_group()
