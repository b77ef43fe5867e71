"""Inputs of one fused-head call, kept in float64, and how a backend's results are compared:
shared by the torch and triton backends' tests (each adds its own direct call and tolerances)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Case:
    """Inputs of one call, kept in float64 so every dtype sees the same values."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    g_lp: torch.Tensor
    g_ent: torch.Tensor


@dataclass
class Result:
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    d_hidden: torch.Tensor | None
    d_weight: torch.Tensor | None


def make_case(
    n: int, h: int, v: int, *, seed: int = 0, peak: float = 1.0, ignore_every: int = 7
) -> Case:
    """docs/design.md's inputs: h ~ N(0, 1), W ~ N(0, (peak / sqrt(H))^2), some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (peak / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return Case(hidden, weight, labels, g_lp, g_ent)


def case_loss(lp: torch.Tensor, ent: torch.Tensor | None, case: Case) -> torch.Tensor:
    """The scalar whose backward applies the case's upstream gradients (float64)."""
    # nansum: a NaN row (out-of-range label) is the caller's to skip; outputs are checked apart.
    loss = (lp.double() * case.g_lp.to(lp.device)).nansum()
    if ent is not None:
        loss = loss + (ent.double() * case.g_ent.to(ent.device)).sum()
    return loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """docs/design.md's relative error ``||a - b|| / ||b||``, in float64 on the CPU."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-300))
