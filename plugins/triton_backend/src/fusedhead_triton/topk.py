"""Launcher of the forward with top-k (``kernels/topk.py``): the forward's tile statistics and
each row's ``k`` most likely ids and their scaled logits, in one pass over the logits tiles.

The vocabulary is cut into chunks of whole tiles (``chunk_tiles``: from V and the tile width,
never from N: every row is computed alike whatever the batch). Each chunk keeps its ``KP`` best
keys per row (``cand[C, N, KP]``, int64, ``O(N k)``); their merge by key is exact and
order-free, so the result is deterministic and batch invariant.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch

from .configs import TileConfig
from .launch import (
    HeadScalars,
    PartialExtras,
    Partials,
    _tiles,
    descriptor,
    forward_workspaces,
    kernel,
    tma_usable,
)

#: Largest ``top_k`` (the running set lives in registers: ``BLOCK_M x KP`` int64 per program).
MAX_TOP_K = 64
#: Vocabulary chunks a row's tiles are cut into (each chunk is one program per row block) ...
CHUNKS = 4
#: ... of at least this many tiles: a chunk's first tile costs about KP rounds (its set starts
#: empty), a later one about KP / j.
MIN_CHUNK_TILES = 16
#: Rows per program: at most 64 (a 128-row block's tile and running set spill registers on
#: sm90). The statistics of a row depend on the tile's columns and K steps, not on its rows.
BLOCK_M = 64


class TopK(NamedTuple):
    """Each row's ``k`` most likely ids (int64, global, most likely first, equal logits by the
    lower id) and their scaled logits (fp32; minus the row's lse: the log-probs)."""

    ids: torch.Tensor
    logits: torch.Tensor


def padded_k(k: int) -> int:
    """Keys kept per row and chunk: ``k`` rounded up to a power of two (at least 2)."""
    return max(2, 1 << (k - 1).bit_length())


def chunk_tiles(v: int, block_n: int, chunks: int | None = None) -> int:
    """Tiles per chunk for a vocabulary of ``v`` columns (a function of V and the tile only):
    ``CHUNKS`` chunks of at least ``MIN_CHUNK_TILES`` tiles, or ``chunks`` chunks if given."""
    tiles = math.ceil(v / block_n)
    if chunks is None:
        return max(1, min(tiles, max(MIN_CHUNK_TILES, math.ceil(tiles / CHUNKS))))
    return max(1, math.ceil(tiles / chunks))


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


def decode(keys: torch.Tensor, id_offset: int) -> TopK:
    """Ids (``id_offset`` added) and fp32 values of int64 keys (``kernels.topk.topk_keys``)."""
    mono = (keys >> 32).to(torch.int32)
    values = (mono ^ ((mono >> 31) & 0x7FFFFFFF)).view(torch.float32)
    ids = (0x7FFFFFFF - (keys & 0xFFFFFFFF)) + id_offset
    return TopK(ids, values)


def merge(cand: torch.Tensor, k: int, id_offset: int) -> TopK:
    """The ``k`` best of the chunks' keys ``cand[C, N, KP]`` per row (keys are distinct: exact)."""
    c, n, kp = cand.shape
    keys = cand.permute(1, 0, 2).reshape(n, c * kp)
    top = torch.topk(keys, k, dim=1, largest=True, sorted=True).values
    return decode(top, id_offset)


def topk_partials(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, cfg: TileConfig, k: int, extras: PartialExtras | None = None, *,
    chunks: int | None = None, block_m: int = BLOCK_M,
) -> tuple[Partials, TopK]:  # fmt: skip
    """``launch.forward_partials``'s statistics (the same logits, sums equal to fp32 rounding)
    and the rows' top ``k`` over this shard's columns (ids offset by ``sc.label_offset``)."""
    check_top_k(k, weight.shape[0])
    cfg = replace(cfg, block_m=min(cfg.block_m, block_m))
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    t = math.ceil(v / cfg.block_n)
    kp = padded_k(k)
    if kp > cfg.block_n:
        raise ValueError(f"top_k: {k} needs tiles of at least {kp} columns, got {cfg.block_n}")
    per = chunk_tiles(v, cfg.block_n, chunks)
    c = math.ceil(t / per)
    ex = extras if extras is not None else PartialExtras()
    ws, zy, q, arg, zg, starts = forward_workspaces(n, t, cfg.block_n, ex, dev)
    k_g = 0 if ex.gather is None else ex.gather.sids.shape[1]
    cand = torch.empty((c, n, kp), dtype=torch.int64, device=dev)
    if n:
        flags = _tiles(
            cfg, hidden.dtype, PER_TOKEN_T=temp is not None, HAS_SOFTCAP=sc.softcap is not None,
            HAS_Q=q is not None, HAS_ARG=arg is not None, HAS_GATHER=zg is not None, KP=kp,
        )  # fmt: skip
        dummy = zy  # never read or written: its flag is off
        extra_args = tuple(
            dummy if x is None else x
            for x in (q, arg, starts, None if ex.gather is None else ex.gather.sids, zg)
        )
        temp_arg = temp if temp is not None else dummy
        use_tma = tma_usable(cfg, hidden.dtype, h, dev)
        strides: tuple[int, ...] = (0, 0, 0, 0)
        if use_tma:
            srcs = (descriptor(hidden, [cfg.block_m, cfg.block_k]),
                    descriptor(weight, [cfg.block_n, cfg.block_k]))  # fmt: skip
        else:
            srcs = (hidden, weight)
            strides = (*hidden.stride(), *weight.stride())
        grid = (math.ceil(n / cfg.block_m) * c,)
        kernel("topk").fwd_topk_kernel[grid](
            *srcs, labels, temp_arg, ws, zy, *extra_args, cand, n, v, h, k_g, per, *strides,
            sc.label_offset, sc.inv_temp, *sc.softcap_args, EVEN_K=h % cfg.block_k == 0,
            USE_TMA=use_tma, **flags,
        )  # fmt: skip
    return Partials(ws, zy, q, arg, zg), merge(cand, k, sc.label_offset)


def finish(top: TopK, lse: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> TopK:
    """``(ids, log-probs)``: logits minus the row's lse; ignored rows give ids -1 and 0."""
    keep = (labels != ignore_index).unsqueeze(1)
    ids = torch.where(keep, top.ids, -1)
    return TopK(ids, torch.where(keep, top.logits - lse.unsqueeze(1), 0.0))
