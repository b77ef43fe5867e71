"""Per-row softmax statistics of a slice of the vocabulary, and how two slices combine exactly.

A slice of scaled logits ``z`` contributes, per row, its max ``m``, ``s = sum exp(z - m)`` and
``t = sum exp(z - m) * (z - m)``. Slices (vocabulary blocks, or the shards of several ranks) merge
without loss, and the full-vocabulary results follow: ``lse = m + log s``, ``H = log s - t / s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
