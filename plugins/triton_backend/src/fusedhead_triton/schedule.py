"""The backward's order of vocabulary blocks, and where each block's ``dz[N, cols]`` lives.

A block's ``dz`` goes either into the block buffer (``backward_block_mib``) or, where the weight
gradient is computed, into rows of it that nothing has written yet: early in the backward most of
dW is still free, so blocks there can be wide without costing memory, and fewer, wider blocks mean
fewer read-modify-writes of the hidden-gradient sum.

With a stashed sum (dW's rows from ``stash`` on hold it until it is final) the stashed rows'
blocks add to dh first, while the free rows are many, and write their dW last, from logits
recomputed once the sum no longer needs those rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One vocabulary block of the backward: rows [v0, v0 + cols) of the vocabulary."""

    v0: int
    cols: int
    #: Row stride of the dz block (``cols`` rounded up to the alignment: TMA-ready rows).
    stride: int
    #: First dW row of the dz block's storage, or None for the block buffer.
    dz_row: int | None
    write_dw: bool
    add_dh: bool


@dataclass(frozen=True)
class Geometry:
    """The shapes that fix a schedule."""

    n: int
    h: int
    v: int
    #: Columns are multiples of this (except the last block of a range).
    align: int
    #: Widest block the buffer holds; the buffer is used for any block narrower than this.
    buffer_cols: int
    max_cols: int
    #: dW rows whose start is 16-byte aligned are multiples of this.
    row_quantum: int = 1


def geometry(
    n: int, h: int, v: int, esize: int, align: int, block_bytes: int, max_cols: int,
    lent_cols: int | None = None,
) -> Geometry:  # fmt: skip
    """The schedule's shapes: blocks are multiples of ``align`` columns, the buffer's within
    ``block_bytes`` (at least one ``align``), none wider than ``max_cols`` (``lent_cols`` for
    those in dW's rows, when given) or the vocabulary."""
    widest = max((lent_cols or max_cols) // align * align, align)
    cols = min(block_bytes // max(1, n * esize), max_cols)
    cols = min(max(align, cols // align * align), _round_up(v, align))
    return Geometry(n, h, v, align, cols, widest, 16 // math.gcd(16, h * esize))


def rows_needed(g: Geometry, stride: int) -> int:
    """dW rows that a dz block of ``stride`` columns occupies (dz and dW share a dtype)."""
    return -(-g.n * stride // g.h) if g.h else 0  # integer ceiling: exact at any size


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def _place(
    g: Geometry, remaining: int, free_lo: int, free_hi: int, own_rows: bool
) -> tuple[int, int | None]:
    """(cols, dz_row) of the next block.

    The widest block whose dz fits in dW rows [free_lo, free_hi) (after the block's own
    ``cols`` rows when ``own_rows``: they are written from that dz), where that is at least as
    wide as the buffer's blocks; else the buffer's width and None.
    """
    buffer_cols = min(g.buffer_cols, remaining)
    per_col = g.n / g.h + (1 if own_rows else 0)
    guess = int(max(0, free_hi - free_lo) / per_col) + g.align
    cols = min(g.max_cols, remaining, _round_up(guess, g.align))
    while cols >= max(buffer_cols, 1):
        start = _round_up(free_lo + (cols if own_rows else 0), g.row_quantum)
        if start + rows_needed(g, _round_up(cols, g.align)) <= free_hi:
            return cols, start
        cols = (cols - 1) // g.align * g.align  # the next narrower aligned width
    return buffer_cols, None


def plan(g: Geometry, *, need_dw: bool, need_dh: bool, stash: int | None) -> list[Step]:
    """The backward's blocks in order.

    ``stash``: first dW row holding the dh sum (None: not stashed; needs both gradients). dz
    blocks live in dW rows not yet written where dW is computed and they fit.
    """
    lend = need_dw and g.h > 0
    tail = stash if (stash is not None and need_dw and need_dh) else g.v
    steps: list[Step] = []

    def run(start: int, end: int, write_dw: bool, add_dh: bool, free_hi: int) -> None:
        v0 = start
        while v0 < end:
            remaining = end - v0
            if lend:  # dh-only steps (stashed rows first) may use any row below the stash
                free_lo, own = (v0, True) if write_dw else (0, False)
                cols, row = _place(g, remaining, free_lo, free_hi, own)
            else:
                cols, row = min(g.buffer_cols, remaining), None
            steps.append(Step(v0, cols, _round_up(cols, g.align), row, write_dw, add_dh))
            v0 += cols

    if tail < g.v:
        run(tail, g.v, False, True, tail)  # the stashed rows' blocks: dh only
    run(0, tail, need_dw, need_dh, tail)
    if tail < g.v:
        run(tail, g.v, True, False, g.v)  # the sum is final: those rows are dW's again
    return steps
