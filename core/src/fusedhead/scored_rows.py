"""The policy loss computes only the rows that count: ignored rows are left out of the backend's
call and their outputs written as the contract gives them (zero statistics, zero hidden gradient).

Rows are independent in every statistic, so a scored row's log-prob and entropy are the bits it
gets in the whole batch (the backends' batch invariance), and each of the three GEMMs shrinks by
the ignored fraction (prompt and padding tokens in an RL batch). The number of scored rows is read
by the host with the call's value checks (one read that happens anyway; in a compiled graph,
where the checks are ops of the graph, at the backend call's graph break); the rows are found on the
device before that read (the gathers queued with the checks), without a read of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fusedhead.protocol import PolicyLossCall, PolicyLossResult


class ScoredRows:
    """The scored rows of one call: found on the device (``queue``), counted by the host
    (``count``, read with the checks in eager mode), then the backend's call narrowed to them
    and its result spread back over every row."""

    __slots__ = ("count", "order", "ordered")

    def __init__(self, order: torch.Tensor, ordered: PolicyLossCall) -> None:
        self.order = order
        self.ordered = ordered
        #: The number of scored rows, set once the host has read it.
        self.count = 0

    @classmethod
    def queue(cls, call: PolicyLossCall, valid: torch.Tensor) -> ScoredRows:
        """Every row's index, the scored ones first, each group in order (a stable sort of the
        mask), and every per-token tensor gathered in that order: queued before the count is
        read, so that after the read only the hidden rows' gather is left (``narrowed``) and the
        GPU waits for one launch, not seven, between the read and the backend's first kernel.
        The hidden states are not gathered here: an RL batch may ignore most of its rows."""
        order = torch.argsort(valid.to(torch.int8), descending=True, stable=True)
        return cls(order, _per_token(call, lambda t: t.index_select(0, order)))

    def narrowed(self) -> PolicyLossCall:
        """The call on the ``count`` scored rows: views, and the hidden rows gathered."""
        k = self.count
        hidden = self.ordered.head.hidden.index_select(0, self.order[:k])
        narrowed = _per_token(self.ordered, lambda t: t[:k])
        return dataclasses.replace(narrowed, head=narrowed.head._replace(hidden=hidden))

    def spread(self, result: PolicyLossResult, call: PolicyLossCall) -> PolicyLossResult:
        """The result on the scored rows as the whole ``call``'s: zeros elsewhere (statistics
        and hidden gradient rows); the weight gradient is the scored rows' alone already."""
        n = call.head.labels.shape[0]
        rows = self.order[: self.count]

        def full(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros((n, *t.shape[1:])).index_copy_(0, rows, t)

        gh = result.grad_hidden
        return PolicyLossResult(
            full(result.log_probs),
            full(result.entropy),
            grad_hidden=None if gh is None else full(gh),
            grad_weight=result.grad_weight,
        )


def _per_token(call: PolicyLossCall, f: Callable[[torch.Tensor], torch.Tensor]) -> PolicyLossCall:
    """``call`` with ``f`` applied to each per-token tensor: the labels, a per-token
    temperature, and the loss's own (old, advantages, token weights, reference, TIS weights)."""

    def each(t: object) -> Any:
        return f(t) if isinstance(t, torch.Tensor) else t

    head = call.head
    head = head._replace(labels=f(head.labels), temperature=each(head.temperature))
    return dataclasses.replace(
        call,
        head=head,
        old_log_probs=each(call.old_log_probs),
        advantages=f(call.advantages),
        token_weight=f(call.token_weight),
        ref_log_probs=each(call.ref_log_probs),
        tis_weight=each(call.tis_weight),
    )


def nothing_scored(call: PolicyLossCall) -> PolicyLossResult:
    """The result where no row counts: zero statistics and zero gradients, no backend run."""
    n = call.head.labels.shape[0]
    lp = torch.zeros(n, dtype=torch.float32, device=call.head.hidden.device)
    gh = torch.zeros_like(call.head.hidden) if call.need_hidden_grad else None
    gw = torch.zeros_like(call.head.weight) if call.need_weight_grad else None
    return PolicyLossResult(lp, lp.clone(), grad_hidden=gh, grad_weight=gw)
