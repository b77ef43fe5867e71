"""The backend's part of a policy-loss call: its result for every row, computed on the scored rows
alone, checked against the contract (``policy_result_checks``)."""

from __future__ import annotations

from typing import Any, NoReturn, Protocol

import torch

from fusedhead.errors import BackendError, note_backend
from fusedhead.policy_result_checks import check_result
from fusedhead.protocol import Capabilities, PolicyLossCall, PolicyLossResult
from fusedhead.scored_rows import ScoredRows, nothing_scored


class PolicyHead(Protocol):
    """What the policy loss needs of a ``FusedHead`` (typed here, so this module imports no api)."""

    backend: Any

    def ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities: ...
    def capabilities(self, device: torch.device) -> Capabilities: ...
    def identity(self) -> dict[str, str | None]: ...
    def broke(self, reason: str) -> NoReturn: ...


def backend_result(
    head: PolicyHead,
    call: PolicyLossCall,
    cast: str | None,
    valid: torch.Tensor | None,
    rows: ScoredRows | None,
) -> PolicyLossResult:
    """The backend's result for every row of ``call``, computed on the scored rows alone where
    ``valid`` is given (``rows``: found and counted with the checks; else found here).

    Always run as in eager mode (``policy._untraced``): in a compiled graph the count is read here,
    so a compiled step hands the backend the same rows as an eager one, with the same bits."""
    n = call.head.labels.shape[0]
    if valid is not None and rows is None:
        rows = ScoredRows.queue(call, valid)
        rows.count = int(valid.sum())
    scored = n if rows is None else rows.count
    if scored == 0:
        return nothing_scored(call)
    sub = call if rows is None or scored == n else rows.narrowed()
    try:  # its policy_loss method is there: the registry checks it where capabilities are read
        with torch.no_grad(), torch.autocast(cast or "cpu", enabled=False):
            result = head.backend.policy_loss(sub)
    except BackendError as exc:
        raise exc.attach(**head.identity()) from None
    except Exception as exc:
        note_backend(exc, **head.identity())
        raise
    check_result(head.broke, sub, result, scored, call.head.hidden.device)
    return result if sub is call or rows is None else rows.spread(result, call)
