"""Per-row softmax statistics of a slice of the vocabulary, and how two slices combine exactly.

A slice of scaled logits ``z`` contributes, per row, its max ``m``, ``s = sum exp(z - m)`` and
``t = sum exp(z - m) * (z - m)``. Slices (vocabulary blocks, or the shards of several ranks) merge
without loss, and the full-vocabulary results follow: ``lse = m + log s``, ``H = log s - t / s``.

The forward combines the statistics of fixed grid tiles (``tiling.GRID_COLS`` columns) by
``combine_tiles``: the row max over all tiles (exact), then each tile's terms rebased onto it and
added as fixed-point integers (exact, in any order). So a row's result depends on the grid only,
never on how many ranks hold the tiles (docs/vocab-parallel.md, "The same bits at any degree").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP32 = torch.float32
#: The max of an empty slice. Finite, so that rebasing an empty slice gives 0 * finite, never NaN.
EMPTY_MAX = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class RowStats:
    """fp32 ``[R]`` tensors ``m`` (max), ``s`` (sum of exp) and ``t`` (sum of exp times offset)."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> RowStats:
        """Statistics of no columns at all: the identity of ``merged``."""
        m = torch.full((rows,), EMPTY_MAX, dtype=torch.float32, device=device)
        zeros = torch.zeros(rows, dtype=torch.float32, device=device)
        return cls(m, zeros, zeros.clone())

    def rebased(self, m_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s`` and ``t`` re-expressed relative to a larger max ``m_new``."""
        shift = self.m - m_new  # <= 0
        scale = torch.exp(shift)
        return self.s * scale, torch.addcmul(self.t, self.s, shift).mul_(scale)

    def merged(self, other: RowStats) -> RowStats:
        """Statistics of the union of both slices of columns."""
        m = torch.maximum(self.m, other.m)
        s_a, t_a = self.rebased(m)
        s_b, t_b = other.rebased(m)
        return RowStats(m, s_a.add_(s_b), t_a.add_(t_b))

    def log_sum_exp(self) -> torch.Tensor:
        """``log sum exp(z)`` over the columns seen."""
        return torch.log(self.s).add_(self.m)

    def entropy(self) -> torch.Tensor:
        """Entropy of ``softmax(z)`` over the columns seen: ``log s - t / s``."""
        return torch.log(self.s).sub_(self.t / self.s)


#: Fraction bits of the fixed-point sums of ``combine_tiles``: each tile's rebased ``s``, ``t``
#: and ``q`` (at most its column count in size) becomes an int64 count of ``2**-FIXED_BITS``, so a
#: row's sums over the whole vocabulary stay below ``2**63`` while ``vocab_size < MAX_GRID_VOCAB``.
FIXED_BITS = 40
#: Vocabulary sizes at and above this could overflow the int64 sums (``2**(63 - FIXED_BITS)``).
MAX_GRID_VOCAB = 2 ** (63 - FIXED_BITS)
_TO_FIXED = float(2**FIXED_BITS)
_FROM_FIXED = float(2.0**-FIXED_BITS)


@dataclass(frozen=True)
class TileStats:
    """fp32 ``[T, R]`` statistics of ``T`` grid tiles (``m``, ``s``, ``t``, and ``q`` = sum of
    ``exp(2 (z - m))`` where asked), each relative to its own tile max."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor
    q: torch.Tensor | None = None

    def row_max(self) -> torch.Tensor:
        """Each row's max over the tiles (``EMPTY_MAX`` without tiles): exact in any order."""
        if self.m.shape[0] == 0:
            return torch.full(self.m.shape[1:], EMPTY_MAX, dtype=FP32, device=self.m.device)
        return self.m.amax(dim=0)

    def fixed_sums(self, m: torch.Tensor) -> torch.Tensor:
        """int64 ``[3 or 4, R]``: the tiles' ``s``, ``t`` (and ``q``) rebased onto the row max
        ``m`` (the whole vocabulary's), each tile's term truncated to a multiple of
        ``2**-FIXED_BITS`` and then summed as integers: exact, so the sums do not depend on how
        the tiles are grouped or ordered (which ranks hold them); the last row counts terms that
        were not finite."""
        shift = self.m - m.unsqueeze(0)  # <= 0
        scale = torch.exp(shift)
        live = scale > 0  # a tile far below the max adds 0 (never -inf * 0)
        terms = [
            self.s * scale,
            torch.where(live, torch.addcmul(self.t, self.s, shift) * scale, 0.0),
        ]
        if self.q is not None:
            terms.append(self.q * (scale * scale))
        stacked = torch.stack(terms)  # [2 or 3, T, R]
        finite = stacked.isfinite()
        fixed = torch.where(finite, stacked * _TO_FIXED, 0.0).to(torch.int64).sum(dim=1)
        # A NaN or inf (a NaN hidden row, inf logits) is counted, never cast to an int64 that
        # would wrap the sum into a plausible value: ``from_fixed`` makes that row NaN.
        broken = (~finite).sum(dim=(0, 1)).unsqueeze(0)
        return torch.cat([fixed, broken])


def from_fixed(sums: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``TileStats.fixed_sums`` (or of their sum over ranks): one rounding each,
    NaN in a row where a term was not finite."""
    values = sums[:-1].to(FP32) * _FROM_FIXED
    return torch.where(sums[-1:] > 0, math.nan, values)


def combine_tiles(
    stats: TileStats, m: torch.Tensor | None = None
) -> tuple[RowStats, torch.Tensor | None]:
    """The whole vocabulary's row statistics from its grid tiles (one process: all of them), and
    ``q`` rebased onto the row max where asked; ``m``: the row max if known (else the tiles')."""
    m = stats.row_max() if m is None else m
    sums = from_fixed(stats.fixed_sums(m))
    return RowStats(m, sums[0], sums[1]), (sums[2] if stats.q is not None else None)
