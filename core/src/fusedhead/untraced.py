"""The core's calls that ``torch.compile`` runs as in eager mode: a graph break, and no frame of
theirs compiled. Imported only where Dynamo is loaded: ``torch.compiler.disable`` imports Dynamo,
1.2 to 1.8 s that a process which never compiles should not spend on its first call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fusedhead.policy_backend import PolicyHead, backend_result
from fusedhead.policy_grads import AttachedGradients
from fusedhead.protocol import PolicyLossCall, PolicyLossResult
from fusedhead.scored_rows import ScoredRows

#: Why a ``fullgraph=True`` compile stops at these calls: Dynamo shows it with its own message.
FULLGRAPH = (
    "fusedhead.fused_policy_loss runs its backend and attaches its gradients outside the graph "
    "(a graph break; its backward reads the upstream scale on the host), so "
    "torch.compile(fullgraph=True) cannot take it: compile without fullgraph "
    "(docs/policy-loss.md), or take fused_head's log-probs, which compile whole, and the loss in "
    "torch"
)


def _untraced(fn: Callable[..., Any]) -> Any:
    """``fn`` as ``torch.compiler.disable`` leaves it, with the reason where torch takes one."""
    try:
        return torch.compiler.disable(fn, reason=FULLGRAPH)  # type: ignore[no-untyped-call]
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable(fn)  # type: ignore[no-untyped-call]


#: The loss's autograd node: Dynamo would trace its backward too, and break the graph at the
#: scale's host read with a warning on every compile.
attach_gradients: Callable[..., torch.Tensor]
attach_gradients = _untraced(AttachedGradients.apply)

#: In a compiled graph the scored rows are counted here, so a compiled step hands the backend the
#: same rows as an eager one, with the same bits.
policy_backend_result: Callable[
    [PolicyHead, PolicyLossCall, str | None, torch.Tensor | None, ScoredRows | None],
    PolicyLossResult,
]
policy_backend_result = _untraced(backend_result)
