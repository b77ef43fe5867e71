"""The policy loss computes only the rows that count: ignored rows are left out of the backend's
call and their outputs written as the contract gives them (zero statistics, zero hidden gradient).

Rows are independent in every statistic, so a scored row's log-prob and entropy are the bits it
gets in the whole batch (the backends' batch invariance), and each of the three GEMMs shrinks by
the ignored fraction (prompt and padding tokens in an RL batch). The number of scored rows is read
by the host with the call's value checks (one read that happens anyway); the rows are found on the
device before that read (the gathers queued with the checks), without a read of their own.
"""

from __future__ import annotations

import dataclasses

import torch

from fusedhead.protocol import PolicyLossCall, PolicyLossResult


def scored_first(valid: torch.Tensor) -> torch.Tensor:
    """Every row's index, the scored rows first, each group in order (a stable sort of the mask).

    Queued before the count is read, with the per-token gathers of ``gather``: after the read
    only the hidden rows' gather is left (``narrow``), so the GPU waits for one launch, not
    seven, between the read and the backend's first kernel."""
    return torch.argsort(valid.to(torch.int8), descending=True, stable=True)


def gather(call: PolicyLossCall, order: torch.Tensor) -> PolicyLossCall:
    """``call`` with every per-token tensor gathered in ``order``, the rest as it is; the hidden
    states are left to ``narrow``, which gathers the scored rows alone (an RL batch may ignore
    most of its rows: a gather of every row would hold them all)."""
    head = call.head
    temp = head.temperature
    head = head._replace(
        labels=head.labels.index_select(0, order),
        temperature=temp.index_select(0, order) if isinstance(temp, torch.Tensor) else temp,
    )

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, order)

    return dataclasses.replace(
        call,
        head=head,
        old_log_probs=pick(call.old_log_probs),
        advantages=call.advantages.index_select(0, order),
        token_weight=call.token_weight.index_select(0, order),
        ref_log_probs=pick(call.ref_log_probs),
        tis_weight=pick(call.tis_weight),
    )


def narrow(call: PolicyLossCall, order: torch.Tensor, count: int) -> PolicyLossCall:
    """The first ``count`` rows of a ``gather``ed call: views, and the hidden rows gathered."""
    head = call.head
    temp = head.temperature
    head = head._replace(
        hidden=head.hidden.index_select(0, order[:count]),
        labels=head.labels[:count],
        temperature=temp[:count] if isinstance(temp, torch.Tensor) else temp,
    )

    def first(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:count]

    return dataclasses.replace(
        call,
        head=head,
        old_log_probs=first(call.old_log_probs),
        advantages=call.advantages[:count],
        token_weight=call.token_weight[:count],
        ref_log_probs=first(call.ref_log_probs),
        tis_weight=first(call.tis_weight),
    )


def spread(result: PolicyLossResult, rows: torch.Tensor, call: PolicyLossCall) -> PolicyLossResult:
    """The result on ``rows`` as the whole call's: zeros elsewhere (statistics and hidden
    gradient rows); the weight gradient is the scored rows' alone already."""
    n = call.head.labels.shape[0]

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((n, *t.shape[1:])).index_copy_(0, rows, t)

    gh = result.grad_hidden
    return PolicyLossResult(
        full(result.log_probs),
        full(result.entropy),
        grad_hidden=None if gh is None else full(gh),
        grad_weight=result.grad_weight,
    )


def nothing_scored(call: PolicyLossCall) -> PolicyLossResult:
    """The result where no row counts: zero statistics and zero gradients, no backend run."""
    n = call.head.labels.shape[0]
    lp = torch.zeros(n, dtype=torch.float32, device=call.head.hidden.device)
    gh = torch.zeros_like(call.head.hidden) if call.need_hidden_grad else None
    gw = torch.zeros_like(call.head.weight) if call.need_weight_grad else None
    return PolicyLossResult(lp, lp.clone(), grad_hidden=gh, grad_weight=gw)
