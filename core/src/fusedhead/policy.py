"""The RL policy loss inside the head: ``FusedHead.policy_loss`` and ``fused_policy_loss``'s body.

The call is checked once (the head's own checks, then the loss's arguments: ``policy_args``,
where the aggregation becomes one weight per token), the backend computes each row's statistics and
the loss's gradients in its forward (three GEMMs per token chunk), its result is checked against the
contract (``policy_result_checks``), and the loss is formed from the statistics it returns, with the
gradients attached for ``loss.backward()`` (``policy_output``). This module is that call path.
docs/policy-loss.md states the semantics (verl's ``core_algos``).
"""

from __future__ import annotations

import sys

import torch

from fusedhead.contract import gate_head, gate_policy_loss
from fusedhead.errors import BackendUnavailableError
from fusedhead.policy_args import policy_call
from fusedhead.policy_backend import PolicyHead, backend_result
from fusedhead.policy_output import PolicyLossOutput, output
from fusedhead.protocol import PolicyLossCall, PolicyLossResult
from fusedhead.request import HeadRequest, PolicyRequest
from fusedhead.scored_rows import ScoredRows
from fusedhead.validation import check_head
from fusedhead.value_checks import Pending


def run(head: PolicyHead, req: PolicyRequest) -> PolicyLossOutput:
    """One policy-loss call on ``head``: the head's checks, the gate, the loss's own arguments,
    the backend's forward, its result checked, the loss formed."""
    _refuse_func_transforms(req)
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
    call, size, n, device, dtype, cast = check_head(head_req, pending)[:6]
    shape = tuple(size)
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
    # The loss's entropy is the policy call's own output (declared by policy_loss), not the
    # head's: the gate asks the head for log-probs only, and the backend still gets the head
    # call's outputs as the protocol gives them (log_probs and entropy).
    outputs = call.outputs
    call = gate_head(
        call._replace(outputs=_LOG_PROBS),
        caps,
        head.identity(),
        None if traced else pending,
        traced and pending is not None,
    )._replace(outputs=outputs)
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


_LOG_PROBS = frozenset({"log_probs"})


def _refuse_func_transforms(req: PolicyRequest) -> None:
    """``torch.func`` transforms (``grad``, ``vmap``) wrap their inputs; the backend's forward
    and the gradients it stores are not written for wrapped tensors: refused before it runs."""
    if torch.compiler.is_compiling():
        return  # Dynamo's fake tensors are never wrapped, and it cannot trace the question
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for name, value in zip(req._fields, req):
        if isinstance(value, torch.Tensor) and wrapped(value):
            raise RuntimeError(
                f"fused_policy_loss does not run under torch.func transforms (grad, vmap, ...): "
                f"{name} is a transform's wrapped tensor. Call it outside the transform: its "
                "loss.backward() gives the gradients of hidden and weight"
            )


def _untraced(
    head: PolicyHead,
    call: PolicyLossCall,
    cast: str | None,
    valid: torch.Tensor | None,
    rows: ScoredRows | None,
) -> PolicyLossResult:
    """``backend_result`` run as in eager mode where Dynamo is loaded (``fusedhead.untraced``):
    under ``torch.compile`` a graph break, and never a frame Dynamo compiles (it compiled the
    triton backend's kernel launches and failed there)."""
    if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
        from fusedhead.untraced import policy_backend_result

        return policy_backend_result(head, call, cast, valid, rows)
    return backend_result(head, call, cast, valid, rows)
