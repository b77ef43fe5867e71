"""Worker for the DDP test: each rank trains a head whose module returns ``PolicyLossOutput``.

``run`` returns, for each DDP mode, the weight gradient after two steps on the rank's half of a
batch; the test compares every rank with one process on the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fusedhead

WORLD, ROWS, SEQ, H, V = 2, 4, 5, 16, 40
MODES = {"static_graph": {"static_graph": True}, "default": {}}


class PolicyHead(nn.Module):
    """One head weight; forward returns the whole ``PolicyLossOutput``, as a trainer might."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(V, H) / 3)
        self.backend = backend

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, tokens: float
    ) -> fusedhead.PolicyLossOutput:
        return fusedhead.fused_policy_loss(
            hidden, self.weight, labels, old_log_probs=None, advantages=advantages,
            backend=self.backend, loss_normalizer=tokens,
        )  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch of a step: hidden, labels, advantages."""
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(ROWS, SEQ, H, generator=g),
        torch.randint(0, V, (ROWS, SEQ), generator=g),
        torch.randn(ROWS, SEQ, generator=g),
    )


def train(module: nn.Module, rows: slice, tokens: float) -> list[torch.Tensor]:
    """The weight gradient after each of two steps on ``rows`` of each step's batch."""
    grads = []
    for step in range(2):
        for p in module.parameters():
            p.grad = None
        hidden, labels, advantages = batch(step)
        out = module(hidden[rows], labels[rows], advantages[rows], tokens)
        out.loss.backward()
        weight = next(module.parameters())
        assert weight.grad is not None
        grads.append(weight.grad.detach().clone())
    return grads


def run(backend: str, rank: int) -> dict[str, list[torch.Tensor]]:
    """Per DDP mode, this rank's gradients (DDP averages them over the ranks)."""
    half = ROWS // WORLD
    rows = slice(rank * half, (rank + 1) * half)
    # Each rank normalises by the global count over the world size: DDP's mean is the whole sum.
    tokens = ROWS * SEQ / WORLD
    return {
        mode: train(DistributedDataParallel(PolicyHead(backend), **kwargs), rows, tokens)
        for mode, kwargs in MODES.items()
    }
