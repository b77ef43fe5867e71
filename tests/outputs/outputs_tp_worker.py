"""One rank of the vocab-parallel check of lse, sum_p2 and gather, started by ``mp.spawn``.

Every rank builds the same problem from a seed, keeps its shard ``[start, stop)`` of the weight,
calls ``fused_head`` over gloo with ``process_group`` and saves outputs and gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

N, H, V, K = 48, 16, 130, 9
#: name -> shard boundaries per world size and whether the hidden gradient is all-reduced.
CASES: dict[str, dict[str, Any]] = {
    "uneven": {"bounds": {2: [0, 17, 130], 3: [0, 70, 71, 130]}, "reduce": True},
    "one-row-shard": {"bounds": {2: [0, 1, 130], 3: [0, 50, 51, 130]}, "reduce": True},
    "partial-dh": {"bounds": {2: [0, 64, 130], 3: [0, 40, 90, 130]}, "reduce": False},
}
OPTIONS = {"chunk_rows": 20, "block_vocab": 24}


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::6] = -100
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[:, 0] = labels.clamp(min=0)
    ids[:, -1] = -100
    return {
        "hidden": torch.randn(N, H, generator=g),
        "weight": torch.randn(V, H, generator=g) * 0.7,
        "labels": labels,
        "ids": ids,
        "temperature": torch.linspace(0.5, 2.0, N),
        "grads": torch.randn(4, N, generator=g),
        "grad_gather": torch.randn(N, K, generator=g),
    }


def run(
    x: dict[str, torch.Tensor], start: int, stop: int, reduce: bool, group: Any
) -> dict[str, Any]:
    """The call on rows ``[start, stop)`` of the weight; outputs and gradients."""
    from fusedhead import fused_head

    h = x["hidden"].clone().requires_grad_(True)
    w = x["weight"][start:stop].clone().requires_grad_(True)
    kw: dict[str, Any] = {}
    if group is not None:
        kw = {
            "process_group": group,
            "vocab_start": start,
            "vocab_size": V,
            "reduce_hidden_grad": reduce,
        }
    out = fused_head(
        h,
        w,
        x["labels"],
        temperature=x["temperature"],
        softcap=3.0,
        gather_ids=x["ids"],
        return_lse=True,
        return_sum_p2=True,
        options=OPTIONS,
        **kw,
    )
    g = x["grads"]
    loss = (out.log_probs * g[0]).sum() + (out.entropy * g[1]).sum() + (out.lse * g[2]).sum()
    loss = loss + (out.sum_p2 * g[3]).sum() + (out.gathered * x["grad_gather"]).sum()
    loss.backward()
    result = {
        f: getattr(out, f).detach() for f in ("log_probs", "entropy", "lse", "sum_p2", "gathered")
    }
    result["grad_hidden"], result["grad_weight"] = h.grad, w.grad
    return result


def worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        x = inputs()
        results = {}
        for name, case in CASES.items():
            b = case["bounds"][world]
            results[name] = run(x, b[rank], b[rank + 1], case["reduce"], dist.group.WORLD)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
