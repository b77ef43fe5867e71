"""The core's calls that ``torch.compile`` runs as in eager mode: a graph break, and no frame of
theirs compiled. Imported only where Dynamo is loaded: ``torch.compiler.disable`` imports Dynamo,
1.2 to 1.8 s that a process which never compiles should not spend on its first call."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedhead.policy_backend import PolicyHead, backend_result
from fusedhead.policy_grads import AttachedGradients
from fusedhead.protocol import PolicyLossCall, PolicyLossResult
from fusedhead.scored_rows import ScoredRows

#: The loss's autograd node: Dynamo would trace its backward too, and break the graph at the
#: scale's host read with a warning on every compile.
attach_gradients: Callable[..., torch.Tensor]
attach_gradients = torch.compiler.disable(AttachedGradients.apply)  # type: ignore[no-untyped-call]

#: In a compiled graph the scored rows are counted here, so a compiled step hands the backend the
#: same rows as an eager one, with the same bits.
policy_backend_result: Callable[
    [PolicyHead, PolicyLossCall, str | None, torch.Tensor | None, ScoredRows | None],
    PolicyLossResult,
]
policy_backend_result = torch.compiler.disable(backend_result)  # type: ignore[no-untyped-call]
