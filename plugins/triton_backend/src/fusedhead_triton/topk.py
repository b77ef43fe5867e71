"""Launcher of the top-k (``kernels/topk.py``): the plain forward, then each row's ``k`` most
likely ids from the few tiles that can hold them, recomputed.

1. ``launch.forward_partials`` (unchanged): the statistics and extras are a plain call's bits,
   and ``ws[0] = m[T, N]`` is each (tile, row)'s max of the scaled logits.
2. ``candidate_tiles``: per row the ``k`` tiles with the largest max, equal maxima by the lower
   tile. Exact: with tau the k-th chosen (max, tile), every top-k entry is >= tau; tiles above
   tau are all chosen, and each chosen tile at tau holds an entry equal to tau with a lower id
   than any entry of an unchosen one, so the k best (value, then lower id) lie in the chosen.
3. ``recompute``: only those tiles, grouped by tile, into ``cand[N, k, BLOCK_N]`` (fp32, the
   peak memory past the forward's: 268 MB at N = 8192, k = 32 and 256-column tiles, 537 MB at
   k = 64); ``select`` folds each row's into its best keys, skipping entries below tau.

All on the device with shapes fixed by N, V and k (no host sync: CUDA graphs, torch.compile);
every step is per row, so the result is deterministic and batch invariant.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch

from .configs import MAX_TOP_K, TileConfig
from .kernels.topk import select_kernel, tiles_at_kernel
from .launch import (
    HeadScalars,
    PartialExtras,
    Partials,
    descriptor,
    forward_partials,
    tile_constants,
    tma_usable,
)

#: Rows per program of the recompute, at most: 128 rows' gathered row pointers spill registers
#: on sm90 (1.9 KB of stack, tools/topk_offline.py); 64 do not (and waste fewer rows per tile).
#: A row's logits do not depend on the rows beside it: the forward's bits either way.
RECOMPUTE_ROWS = 64
#: Rows per program of the selection (small: many programs, a small tile in registers).
SELECT_ROWS = 16
#: Tiles per slot when the candidate tiles are selected by the same fold (594 at Qwen's V).
TILE_SLOT = 64


class TopK(NamedTuple):
    """Each row's ``k`` most likely ids (int64, global, most likely first, equal logits by the
    lower id) and their scaled logits (fp32; minus the row's lse: the log-probs)."""

    ids: torch.Tensor
    logits: torch.Tensor


def check_top_k(k: object, vocab_size: int) -> int:
    """``k`` as an int in ``[1, min(MAX_TOP_K, vocab_size)]``, else ValueError/TypeError naming
    ``top_k``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"top_k: expected an int, got {type(k).__name__} {k!r}")
    if k < 1 or k > MAX_TOP_K:
        raise ValueError(f"top_k: the triton backend takes 1 to {MAX_TOP_K}, got {k}")
    if k > vocab_size:
        raise ValueError(f"top_k: {k} is more than the vocabulary's {vocab_size} ids")
    return k


def decode(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (index, fp32 value) pairs int64 keys were made from."""
    mono = (keys >> 32).to(torch.int32)
    values = (mono ^ ((mono >> 31) & 0x7FFFFFFF)).view(torch.float32)
    return 0x7FFFFFFF - (keys & 0xFFFFFFFF), values


def candidate_tiles(m: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the ``min(k, T)`` tiles with the largest tile max ``m[T, N]`` (equal maxima: the
    lower tile), in ascending tile order (``[N, min(k, T)]`` int64), and the row's floor: the
    k-th largest tile max (k entries reach it, so no top-k entry is below it), -inf if T < k."""
    (t, n), w = m.shape, TILE_SLOT
    # The rows' tile maxima as slots of w tiles (padded with -inf), folded like logits tiles.
    mt = torch.nn.functional.pad(m.t(), (0, -t % w), value=float("-inf")).contiguous()
    none = torch.full((n,), float("-inf"), device=m.device)
    tiles, maxima = decode(torch.topk(_best_keys(mt.view(n, -1, w), none, k), min(k, t)).values)
    floor = maxima.amin(dim=1) if t >= k else none
    return torch.sort(tiles, dim=1).values, floor


def recompute(
    hidden: torch.Tensor, weight: torch.Tensor, temp: torch.Tensor | None, sc: HeadScalars,
    cfg: TileConfig, tiles: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``cand[n, j, :]``: row ``n``'s scaled logits over tile ``tiles[n, j]`` (the forward's
    bits; columns past V at -inf), fp32 ``[N, KT, BLOCK_N]``."""
    (n, h), v = hidden.shape, weight.shape[0]
    cfg = replace(cfg, block_m=min(cfg.block_m, RECOMPUTE_ROWS))
    kt, bm, bn = tiles.shape[1], cfg.block_m, cfg.block_n
    t = math.ceil(v / bn)
    cand = torch.empty((n, kt, bn), dtype=torch.float32, device=hidden.device)
    # The (row, slot) pairs row * KT + slot grouped by tile; a program per chunk of BM pairs
    # of one tile: at most ceil(N KT / BM) + T programs, those past the end do nothing.
    by_tile, pairs = torch.sort(tiles.reshape(-1), stable=True)
    starts = torch.searchsorted(by_tile, torch.arange(t + 1, device=tiles.device))
    chunks = (starts[1:] - starts[:-1] + bm - 1) // bm
    ends = torch.cumsum(chunks, 0)
    g = math.ceil(n * kt / bm) + t
    pid = torch.arange(g, device=tiles.device)
    tile = torch.searchsorted(ends, pid, right=True)
    at = tile.clamp(max=t - 1)
    first = starts[at] + (pid - ends[at] + chunks[at]) * bm
    prog = torch.stack((tile, first)).to(torch.int32)
    flags = tile_constants(
        cfg, hidden.dtype, PER_TOKEN_T=temp is not None, HAS_SOFTCAP=sc.softcap is not None
    )
    del flags["GROUP_M"]
    use_tma = tma_usable(cfg, hidden.dtype, h, hidden.device)  # the weight as the forward loads it
    w_src = descriptor(weight, [bn, cfg.block_k]) if use_tma else weight
    tiles_at_kernel[(g,)](
        hidden, w_src, cand if temp is None else temp, prog, starts, pairs, cand, n, v, h, kt, g,
        *hidden.stride(), *weight.stride(), sc.inv_temp, *sc.softcap_args,
        EVEN_K=h % cfg.block_k == 0, USE_TMA=use_tma, **flags,
    )  # fmt: skip
    return cand


def _best_keys(cand: torch.Tensor, floor: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's best keys (at least ``k``, unordered) of ``cand[N, S, W]``, column ``j * W + c``
    for slot ``j``'s ``c``, skipping the entries below ``floor[N]``."""
    n, s, w = cand.shape
    kp = max(2, 1 << (k - 1).bit_length())  # keys kept per row: a power of two
    keys = torch.empty((n, kp), dtype=torch.int64, device=cand.device)
    if n:
        select_kernel[(math.ceil(n / SELECT_ROWS),)](
            cand, floor, keys, n, s, BLOCK_R=SELECT_ROWS, BLOCK_N=w, KP=kp, num_warps=4
        )
    return keys


def select(
    cand: torch.Tensor, tiles: torch.Tensor, floor: torch.Tensor, k: int, id_offset: int, v: int
) -> TopK:
    """Each row's ``k`` best (value, then lower id) of its candidate tiles ``cand[N, KT, BN]``
    (``tiles[N, KT]`` ascending; ``floor[N]`` at most the k-th best value), ids offset by
    ``id_offset``; an entry whose id falls outside the shard's ``v`` columns gives id -1 and
    value NaN.

    A row whose logits are not all finite (a NaN or inf in its hidden state) has no ranking:
    its candidate tiles and keys are the selection's empty ones, whose columns lie past the
    row's slots and whose tiles past V. Such an entry is never used as an index (the gather
    below would overrun, a device-side assert on CUDA) and reads -1, as the row's argmax does.
    """
    kt, bn = cand.shape[1], cand.shape[2]
    col, values = decode(torch.topk(_best_keys(cand, floor, k), k, dim=1, sorted=True).values)
    slot = col // bn
    ids = tiles.gather(1, slot.clamp(0, kt - 1)) * bn + col % bn + id_offset
    inside = (slot >= 0) & (slot < kt) & (ids >= id_offset) & (ids < id_offset + v)
    return TopK(torch.where(inside, ids, -1), torch.where(inside, values, float("nan")))


def topk_partials(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, cfg: TileConfig, k: int, extras: PartialExtras | None = None,
) -> tuple[Partials, TopK]:  # fmt: skip
    """``launch.forward_partials`` (its bits) and the rows' top ``k`` over this shard's columns
    (ids offset by ``sc.label_offset``)."""
    check_top_k(k, weight.shape[0])
    p = forward_partials(hidden, weight, labels, temp, sc, cfg, extras)
    if hidden.shape[0] == 0:  # no rows: no candidates to choose (a [0, -1] view is ambiguous)
        ids = torch.empty((0, k), dtype=torch.int64, device=hidden.device)
        return p, TopK(ids, torch.empty((0, k), dtype=torch.float32, device=hidden.device))
    tiles, floor = candidate_tiles(p.ws[0], k)
    cand = recompute(hidden, weight, temp, sc, cfg, tiles)
    return p, select(cand, tiles, floor, k, sc.label_offset, weight.shape[0])


def ranked_rows(m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """Rows with a most likely id: those whose row max and log s are finite. A NaN logit makes
    log s NaN (the combine counts such terms, over every rank); a +inf one makes the max +inf
    (its tile's terms vanish, so log s reads -inf); either way the row's log-probs are NaN, and
    its argmax and top-k ids are -1, as an ignored row's, at any degree and on every backend."""
    return torch.isfinite(m) & torch.isfinite(log_s)


def finish(
    top: TopK, m: torch.Tensor, log_s: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> TopK:
    """``(ids, log-probs)``: ``(logit - row max) - log s``, as the label's; ignored rows give
    ids -1 and 0, a row with a NaN or infinite logit ids -1 (``ranked_rows``)."""
    keep = (labels != ignore_index).unsqueeze(1)
    ids = torch.where(keep & ranked_rows(m, log_s).unsqueeze(1), top.ids, -1)
    lp = (top.logits - m.unsqueeze(1)) - log_s.unsqueeze(1)
    return TopK(ids, torch.where(keep, lp, 0.0))
