"""How the ``[N, V]`` logits are cut into tiles that fit a workspace budget.

The forward walks the vocabulary grid (``plan_forward_tiles``); the backward walks wider blocks
(``plan_tiles``) whose auto-planned sizes are whole forward tiles, so that it recomputes each
logit with the forward's GEMM of the same shape (``tile_math.forward_logits``) and no more.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: The forward's vocabulary grid: its logits GEMMs are blocks of exactly this many columns from
#: each shard's start, whose statistics ``rowstats.combine_tiles`` adds exactly. A shard starting
#: on a multiple of it gives the one-process bits (docs/vocab-parallel.md).
GRID_COLS = 1024
#: Auto-planned vocabulary blocks are at least this wide (when V allows); rows shrink instead.
MIN_AUTO_COLS = 1024
#: Auto-planned blocks are rounded to a multiple of this many columns, for GEMM-friendly shapes.
COL_ALIGN = 64


@dataclass(frozen=True)
class Tiles:
    """Rows per chunk and vocabulary columns per block."""

    rows: int
    cols: int

    def row_ranges(self, n: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of each row chunk."""
        return _ranges(n, self.rows)

    def col_ranges(self, v: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` of each vocabulary block."""
        return _ranges(v, self.cols)


def _ranges(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _balanced(total: int, width: int) -> int:
    """A width up to ``width`` that cuts ``total`` into equal, aligned pieces: whole grid tiles
    (``GRID_COLS``) once it is that wide, so the backward's blocks nest the forward's."""
    if width >= total:
        return total
    if width >= GRID_COLS:
        tiles = _ceil_div(total, GRID_COLS)
        return _ceil_div(tiles, _ceil_div(tiles, width // GRID_COLS)) * GRID_COLS
    pieces = _ceil_div(total, width)
    even = _ceil_div(total, pieces)
    aligned = _ceil_div(even, COL_ALIGN) * COL_ALIGN
    return even if aligned > width else aligned


def plan_tiles(
    n: int,
    v: int,
    *,
    bytes_per_element: int,
    budget_bytes: int,
    chunk_rows: int | None = None,
    block_vocab: int | None = None,
) -> Tiles:
    """Tiles for ``n`` rows and ``v`` columns: explicit sizes win, the budget fills in the rest.

    The budget bounds ``rows * cols * bytes_per_element``, the fp32 and input-dtype buffers one
    tile needs at once. Without explicit sizes, all rows are kept and the vocabulary is cut into
    blocks; rows are chunked only when a block would otherwise be narrower than ``MIN_AUTO_COLS``.
    """
    n, v = max(n, 1), max(v, 1)
    elements = max(1, budget_bytes // bytes_per_element)
    if chunk_rows is not None and block_vocab is not None:
        return Tiles(min(n, chunk_rows), min(v, block_vocab))
    if block_vocab is not None:
        cols = min(v, block_vocab)
        # rows in whole forward chunks (``forward_rows``: the forward takes as many per tile)
        fwd = forward_rows(elements, block_vocab)
        return Tiles(min(n, max(fwd, elements // cols // fwd * fwd)), cols)
    if chunk_rows is not None:
        rows = min(n, chunk_rows)
        # at least one forward tile wide (the forward's own tile, whatever the budget)
        return Tiles(rows, _balanced(v, max(min(v, GRID_COLS), elements // rows)))
    cols = elements // n
    if cols >= min(v, MIN_AUTO_COLS):
        return Tiles(n, _balanced(v, cols))
    cols = min(v, MIN_AUTO_COLS)
    # rows in whole forward chunks, so the tiles nest
    fwd = forward_rows(elements, None)
    return Tiles(min(n, max(fwd, elements // cols // fwd * fwd)), cols)


def forward_rows(elements: int, block_vocab: int | None) -> int:
    """The forward's rows per tile from the budget: as many as a tile of the grid's width (or of
    a wider ``block_vocab``, so the backward's blocks of that width take whole forward chunks)."""
    return max(1, elements // max(GRID_COLS, block_vocab or 0))


def plan_forward_tiles(
    n: int,
    v: int,
    *,
    bytes_per_element: int,
    budget_bytes: int,
    chunk_rows: int | None = None,
    block_vocab: int | None = None,
) -> Tiles:
    """The forward's tiles: ``GRID_COLS`` columns (fewer when ``v`` is smaller), rows from
    ``chunk_rows`` or the budget (``forward_rows``), never from ``v``, so every rank cuts its
    rows alike."""
    cols = min(max(v, 1), GRID_COLS)
    if chunk_rows is not None:
        return Tiles(min(max(n, 1), chunk_rows), cols)
    elements = max(1, budget_bytes // bytes_per_element)
    return Tiles(min(max(n, 1), forward_rows(elements, block_vocab)), cols)


def skips_rows(option: bool | None, hidden: torch.Tensor) -> bool:
    """Whether ignored rows are left out of the tiles (``skip_ignored_rows``) rather than masked.

    Never while torch.compile traces: the kept rows' count is data-dependent, so the rows are
    masked instead (the same values on scored rows, 0 elsewhere) and the graph has fixed shapes.
    """
    skip = hidden.device.type == "cpu" if option is None else option
    return skip and not torch.compiler.is_compiling()
