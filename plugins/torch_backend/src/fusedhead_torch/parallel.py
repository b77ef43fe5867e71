"""Vocab-parallel collectives: combine per-rank row statistics and sum hidden gradients.

Each rank holds a contiguous shard of the vocabulary (shards may differ in size, or be empty). A
rank's per-row statistics are those of its grid tiles; two all-reduces (a MAX of the row max,
then one int64 SUM of the tiles' fixed-point sums, of the label logit's bits, which exactly one
rank owns, and of every rank's shard bounds, which each rank checks against vocab_size) give
every rank the values of the full vocabulary, the one-process bits where the shards lie on the
grid (``all_reduce_tile_stats``). Per-row candidate lists (top-k) are all-gathered and merged by
the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fusedhead.shards import check_shards, shard_slots_tensor, shards_need_check
from fusedhead_torch.rowstats import FP32, RowStats, TileStats, from_fixed


def all_reduce_row_stats(
    stats: RowStats, label_logit: torch.Tensor, group: Any, shard: tuple[int, int, int]
) -> tuple[RowStats, torch.Tensor]:
    """Full-vocabulary statistics and label logit from every rank's shard values.

    ``label_logit`` is the label's scaled logit on the rank that owns the label and 0 elsewhere.
    ``shard``: this rank's (vocab_start, local rows, vocab_size). Every rank's rides in the SUM
    all-reduce (``SHARD_FLOATS`` floats in its own slot), so each rank checks the shards' union
    against vocab_size with no further collective (``fusedhead.shards.check_shards``).
    """
    m = stats.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, t = stats.rebased(m)
    n = s.shape[0]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = shard_slots_tensor(*shard, s.device, world, rank)
    packed = torch.cat([s, t, label_logit.to(s.dtype), slots.reshape(-1)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    if not torch.compiler.is_compiling() and shards_need_check(group, *shard, s.device):
        check_shards(packed[3 * n :], rank, group, *shard)
    rows = packed[: 3 * n].view(3, n)
    return RowStats(m, rows[0], rows[1]), rows[2]


def all_reduce_tile_stats(
    stats: TileStats, label_logit: torch.Tensor, group: Any, shard: tuple[int, int, int]
) -> tuple[RowStats, torch.Tensor, torch.Tensor | None]:
    """Full-vocabulary statistics, label logit and ``q`` (where ``stats.q``) from every rank's
    grid tiles, bit for bit those of one process holding them all (``rowstats.combine_tiles``).

    Two collectives: a MAX all-reduce of the row max (fp32 ``[N]``), then one int64 SUM
    all-reduce of the fixed-point sums (``[3 or 4, N]``), the label logit's bits (exactly one
    rank owns it, the others add 0) and each rank's shard in its own slot (``SHARD_FLOATS`` per
    rank), which every rank checks against vocab_size (``fusedhead.shards.check_shards``).
    Integer sums are exact, so the order the ranks are added in changes nothing.
    """
    m = stats.row_max().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = stats.fixed_sums(m)
    k, n = sums.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = shard_slots_tensor(*shard, m.device, world, rank).reshape(-1).to(torch.int64)
    bits = label_logit.to(FP32).contiguous().view(torch.int32).to(torch.int64)
    packed = torch.cat([sums.reshape(-1), bits, slots])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    if not torch.compiler.is_compiling() and shards_need_check(group, *shard, m.device):
        check_shards(packed[(k + 1) * n :], rank, group, *shard)
    values = from_fixed(packed[: k * n].view(k, n))
    z_label = packed[k * n : (k + 1) * n].to(torch.int32).view(FP32)
    return RowStats(m, values[0], values[1]), z_label, (values[2] if stats.q is not None else None)


def all_reduce_sum_(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``tensor`` over the group in place (the hidden gradient of a replicated ``hidden``)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_rows(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape on all ranks), in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces
