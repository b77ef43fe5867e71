"""Vocab-parallel glue: gather every rank's per-row partial statistics, sum the hidden gradient.

Each rank contributes its shard's combined (m, s, w) per row and its label logit where the label
falls in its shard. An all-gather (not an all-reduce) keeps the cross-rank combine in a fixed
order, so the result is the same bits on every rank and every run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_row_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    w: torch.Tensor,
    zy: torch.Tensor,
    owned: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``stats[3, R, N]`` (ranks as tiles, rank order) and the label logit ``zy[N]``.

    ``zy`` is NaN for a row whose label no rank owns (an out-of-range label).
    """
    world = dist.get_world_size(group)
    local = torch.stack([m, s, w, torch.where(owned, zy, 0.0), owned.to(torch.float32)])
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    every = torch.stack(parts, dim=1)  # [5, R, N]
    stats = every[:3].contiguous()
    owners = every[4].sum(0)
    label_logit = every[3].sum(0)  # exact: at most one rank holds a non-zero value
    label_logit = torch.where(owners == 1, label_logit, float("nan"))
    return stats, label_logit


def all_reduce_sum(t: torch.Tensor, group: Any) -> None:
    """Sum ``t`` in place over the group."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
