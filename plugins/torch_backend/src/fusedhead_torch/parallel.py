"""Vocab-parallel collectives: combine per-rank row statistics and sum hidden gradients.

Each rank holds a contiguous shard of the vocabulary (shards may differ in size, or be empty). A
rank's per-row statistics cover its shard; two all-reduces (a MAX of the row max, then one SUM of
the rebased sums and of the label logit, which exactly one rank owns) give every rank the values
of the full vocabulary. Per-row candidate lists (top-k) are all-gathered and merged by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fusedhead_torch.rowstats import RowStats


def all_reduce_row_stats(
    stats: RowStats, label_logit: torch.Tensor, group: Any
) -> tuple[RowStats, torch.Tensor]:
    """Full-vocabulary statistics and label logit from every rank's shard values.

    ``label_logit`` is the label's scaled logit on the rank that owns the label and 0 elsewhere.
    """
    m = stats.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, t = stats.rebased(m)
    packed = torch.stack([s, t, label_logit])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return RowStats(m, packed[0], packed[1]), packed[2]


def all_reduce_sum_(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (the hidden gradient of a replicated ``hidden``)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_rows(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape on all ranks), in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces
