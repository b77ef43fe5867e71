"""The inputs the kit feeds a backend: docs/design.md's accuracy inputs, from a fixed generator.

``h ~ N(0, 1)``, ``W ~ N(0, (s / sqrt(H))^2)`` (``s = 1`` flat, ``s = 4`` peaked), a tenth of the
labels set to ``ignore_index``. Values are drawn in fp32 on the CPU, then cast and moved, so the
float64 reference sees exactly the values the backend sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

FLAT = 1.0
PEAKED = 4.0
IGNORE_INDEX = -100
#: docs/design.md's temperature for accuracy measurements.
TEMPERATURE = 0.7


@dataclass(frozen=True)
class Case:
    """One problem: hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]`` and how it was made."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    description: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """(N, H, V) with N the number of rows."""
        return (self.labels.numel(), self.weight.shape[1], self.weight.shape[0])

    def to(self, device: torch.device, dtype: torch.dtype) -> Case:
        """The same values on ``device`` in ``dtype`` (labels stay int64)."""
        return replace(
            self,
            hidden=self.hidden.to(device=device, dtype=dtype),
            weight=self.weight.to(device=device, dtype=dtype),
            labels=self.labels.to(device),
        )


def make_case(
    n: int,
    h: int,
    v: int,
    *,
    scale: float = FLAT,
    seed: int = 0,
    ignore_fraction: float = 0.1,
    ignore_index: int = IGNORE_INDEX,
    lead: tuple[int, ...] | None = None,
) -> Case:
    """docs/design.md's inputs with ``n`` rows (shaped ``lead`` if given), on the CPU in fp32."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (scale / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=g)
    n_ignored = round(n * ignore_fraction)
    if n_ignored:
        labels[torch.randperm(n, generator=g)[:n_ignored]] = ignore_index
    if lead is not None:
        hidden = hidden.reshape(*lead, h)
        labels = labels.reshape(lead)
    kind = {FLAT: "flat", PEAKED: "peaked"}.get(scale, f"s={scale:g}")
    return Case(hidden, weight, labels, f"{kind} N={n} H={h} V={v}")


#: What an ignored row's hidden state holds in a poisoned case, cycled over the ignored rows:
#: the whole row NaN, +Inf or -Inf, or one NaN among finite values.
POISONS = ("nan", "inf", "-inf", "one nan")


def poison_ignored(case: Case, ignore_index: int = IGNORE_INDEX) -> Case:
    """The case with NaN and +-Inf hidden states at its ignored rows (``POISONS``), as a padding
    row after fully-masked attention holds: a backend must select such rows out, never scale by 0."""
    hidden = case.hidden.clone()
    flat = hidden.view(-1, hidden.shape[-1])
    rows = (case.labels.reshape(-1) == ignore_index).nonzero().reshape(-1).tolist()
    for i, row in enumerate(rows):
        kind = POISONS[i % len(POISONS)]
        if kind == "one nan":
            flat[row, row % flat.shape[1]] = math.nan
        else:
            flat[row] = float(kind)
    what = f"{case.description}, NaN/+Inf/-Inf hidden states at the {len(rows)} ignored rows"
    return replace(case, hidden=hidden, description=what)


def upstream(shape: tuple[int, ...] | torch.Size, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random upstream gradients (g_log_probs, g_entropy), fp32 on the CPU, from a fixed seed."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(tuple(shape), generator=g), torch.randn(tuple(shape), generator=g)
