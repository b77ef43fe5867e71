"""The RL policy loss inside the head: ``FusedHead.policy_loss`` and ``fused_policy_loss``'s body.

The call is checked once (the head's own checks, then the loss's arguments: ``policy_args``,
where the aggregation becomes one weight per token), the backend computes each row's statistics and
the loss's gradients in its forward (three GEMMs per token chunk), its result is checked against the
contract (``policy_result_checks``), and the loss is formed from the statistics it returns, with the
gradients attached for ``loss.backward()`` (``policy_output``). This module is that call path.
docs/policy-loss.md states the semantics (verl's ``core_algos``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import torch

from fusedhead.contract import gate_head, gate_policy_loss
from fusedhead.errors import BackendError, BackendUnavailableError, note_backend
from fusedhead.policy_args import policy_call
from fusedhead.policy_output import PolicyLossOutput, output
from fusedhead.policy_result_checks import check_result
from fusedhead.protocol import Capabilities, PolicyLossCall, PolicyLossResult
from fusedhead.request import HeadRequest, PolicyRequest
from fusedhead.scored_rows import ScoredRows, nothing_scored
from fusedhead.validation import validate
from fusedhead.value_checks import Pending


class _Head(Protocol):
    """What the policy loss needs of a ``FusedHead`` (typed here, so this module imports no api)."""

    backend: Any

    def ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities: ...
    def capabilities(self, device: torch.device) -> Capabilities: ...
    def identity(self) -> dict[str, str | None]: ...
    def broke(self, reason: str) -> NoReturn: ...


def run(head: _Head, req: PolicyRequest) -> PolicyLossOutput:
    """One policy-loss call on ``head``: the head's checks, the gate, the loss's own arguments,
    the backend's forward, its result checked, the loss formed."""
    head_req = HeadRequest(
        req.hidden,
        req.weight,
        req.labels,
        temperature=req.temperature,
        ignore_index=req.ignore_index,
        check_labels=req.check_labels,
        softcap=req.softcap,
    )
    # The value checks (labels' range, per-token temperatures, a loss_normalizer tensor's value)
    # and the number of scored rows, read by the host once, before the backend runs.
    pending = Pending() if req.check_labels is True else None
    call, shape, n, device, dtype, cast = validate(head_req, pending)
    shape = tuple(shape)
    try:
        caps = head.ready(device, dtype)
    except BackendUnavailableError:
        # A backend that never computes the loss says so, not how to make it run here (liger:
        # "install the CuTe DSL" would lead to the same refusal).
        gate_policy_loss(head.capabilities(device), head.identity())
        raise
    gate_policy_loss(caps, head.identity())
    # A per-token temperature under the backend's min_temperature is refused in the one read
    # (traced: by an op of the graph), as fused_head refuses it.
    traced = torch.compiler.is_compiling()
    call = gate_head(
        call, caps, head.identity(), None if traced else pending, traced and pending is not None
    )
    valid = call.labels != call.ignore_index
    count = valid.sum()
    pcall = policy_call(call, shape, n, device, req, valid, count, pending)
    rows: ScoredRows | None = None
    if pending is not None:
        if not traced:  # the count read with the checks, the rows gathered before that read
            pending.count(count)
            rows = ScoredRows.queue(pcall, valid)
        pending.send()
        pending.settle()
        if rows is not None:
            rows.count = pending.counts[0]
    result = _untraced(head, pcall, cast, valid if pending is not None else None, rows)
    return output(pcall, result, shape)


def _backend_result(
    head: _Head,
    call: PolicyLossCall,
    cast: str | None,
    valid: torch.Tensor | None,
    rows: ScoredRows | None,
) -> PolicyLossResult:
    """The backend's result for every row of ``call``, computed on the scored rows alone where
    ``valid`` is given (``rows``: found and counted with the checks; else found here).

    Always run as in eager mode (``_untraced``): in a compiled graph the count is read here,
    so a compiled step hands the backend the same rows as an eager one, with the same bits."""
    n = call.head.labels.shape[0]
    if valid is not None and rows is None:
        rows = ScoredRows.queue(call, valid)
        rows.count = int(valid.sum())
    scored = n if rows is None else rows.count
    if scored == 0:
        return nothing_scored(call)
    sub = call if rows is None or scored == n else rows.narrowed()
    method = getattr(head.backend, "policy_loss", None)
    if not callable(method):
        head.broke("declares policy_loss but has no policy_loss(call) method")
    try:
        with torch.no_grad(), torch.autocast(cast or "cpu", enabled=False):
            result = method(sub)
    except BackendError as exc:
        raise exc.attach(**head.identity()) from None
    except Exception as exc:
        note_backend(exc, **head.identity())
        raise
    check_result(head.broke, sub, result, scored, call.head.hidden.device)
    return result if sub is call or rows is None else rows.spread(result, call)


#: ``_backend_result`` run as in eager mode: under ``torch.compile`` a graph break, and never a
#: frame Dynamo compiles (it compiled the triton backend's kernel launches and failed there).
#: About 1 us a call in eager mode.
_untraced: Callable[
    [_Head, PolicyLossCall, str | None, torch.Tensor | None, ScoredRows | None], PolicyLossResult
]
_untraced = torch.compiler.disable(_backend_result)  # type: ignore[no-untyped-call]  # untyped
