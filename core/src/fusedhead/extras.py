"""The outputs beyond (log_probs, entropy): the contract of each, checked on what a backend returns.

``lse`` (log-sum-exp, for z-loss), ``sum_p2`` (sum of squared probabilities), ``argmax`` (token
accuracy), ``topk`` (``topk_ids``, ``topk_log_probs``) and ``gather`` (``gathered``). The core asks
for them through :class:`~fusedhead.protocol.HeadCall` and reshapes them to the labels' shape
(plus ``k`` or ``K``) here, so ``api.py`` only routes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch

from fusedhead.protocol import OUTPUT_FIELDS, Capabilities, HeadCall, HeadOutput, KLOutput

#: Fields of ``HeadOutput`` past (log_probs, entropy), in the order ``FusedHeadOutput`` lists them.
EXTRA_FIELDS: tuple[str, ...] = (
    "lse",
    "sum_p2",
    "argmax",
    "topk_ids",
    "topk_log_probs",
    "gathered",
)
#: Outputs past (log_probs, entropy).
EXTRA_OUTPUTS: tuple[str, ...] = ("lse", "sum_p2", "argmax", "topk", "gather")
#: Fields that are integer ids, never differentiable.
_ID_FIELDS = frozenset({"argmax", "topk_ids"})
#: The outputs every backend computes; a call asking for no more takes the short path.
BASIC_OUTPUTS = _BASIC = frozenset({"log_probs", "entropy"})


def _width(call: HeadCall, field: str) -> int | None:
    """The last dimension of a field (``k`` or ``K``), or None for an ``[N]`` field."""
    if field in ("topk_ids", "topk_log_probs"):
        return call.top_k
    if field == "gathered":
        assert call.gather_ids is not None
        return int(call.gather_ids.shape[1])
    return None


def capability_refusal(call: HeadCall, caps: Capabilities) -> tuple[str, str, str] | None:
    """(reason, capability, hint) when ``caps`` cannot serve the extras of ``call``, else None."""
    if call.top_k and call.top_k > caps.max_top_k:
        return (
            f"takes top_k up to {caps.max_top_k}, got top_k={call.top_k}",
            "max_top_k",
            "ask for fewer ids, or name a backend with a larger max_top_k",
        )
    if call.process_group is not None:
        missing = sorted(call.outputs.difference(caps.vocab_parallel_outputs))
        if missing:
            return (
                f"does not compute {missing} under process_group (vocab-parallel it computes "
                f"{list(caps.vocab_parallel_outputs)})",
                "vocab_parallel_outputs",
                "drop them from the call, run without process_group, or name a backend that "
                "declares them in vocab_parallel_outputs",
            )
    return None


#: Autograd nodes ``graph_breach`` visits at most before it gives up looking (and passes).
_MAX_NODES = 100_000


def _unreached(node: Any, inputs: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of ``inputs`` (each requiring grad) that the graph from ``node`` never reaches: a
    non-leaf input by its ``grad_fn``, a leaf by the ``AccumulateGrad`` node holding it."""
    targets = {name: t.grad_fn for name, t in inputs.items() if t.requires_grad}
    missing = set(targets)
    seen: set[int] = set()
    stack = [node]
    while stack and missing and len(seen) < _MAX_NODES:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        for name in list(missing):
            target = targets[name]
            if (fn is target) if target is not None else (var is inputs[name]):
                missing.discard(name)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    if len(seen) >= _MAX_NODES:
        return []  # too large a graph to tell: no verdict
    return sorted(missing)


def graph_breach(what: str, t: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> str | None:
    """Why the differentiable output ``t`` cannot carry a gradient back to ``inputs`` (those
    requiring grad), or None: no graph at all (``grad_fn`` None, whatever ``requires_grad``
    says: ``torch.zeros(n, requires_grad=True)``, ``.detach().requires_grad_()``), or a graph
    that never reaches one of them. Not under Dynamo's tracing, which cannot read ``grad_fn``."""
    fn = t.grad_fn
    if fn is None:
        flag = "requires_grad is True but " if t.requires_grad else ""
        return (
            f"{what} is not attached to hidden or weight ({flag}grad_fn is None: a tensor the "
            "backend made or detached, not one computed from them), so no gradient would reach "
            "the model"
        )
    missing = _unreached(fn, inputs)
    if missing:
        return (
            f"{what}'s autograd graph does not reach {' or '.join(missing)}, which "
            f"{'requires' if len(missing) == 1 else 'require'} grad: the backend detached it "
            "from them, so no gradient would reach the model"
        )
    return None


def check_extras(
    call: HeadCall,
    out: HeadOutput,
    needs_grad: bool,
    broke: Callable[[str], NoReturn],
    graph: bool = False,
) -> None:
    """Each extra field is set exactly when requested, with its dtype, shape, device and grad;
    ``graph`` (eager, gradients recorded): each differentiable one also reaches hidden and weight
    (``graph_breach``)."""
    n = call.labels.shape[0]
    device = call.hidden.device
    wanted = {f for o in call.outputs for f in OUTPUT_FIELDS.get(o, ())}
    for field in EXTRA_FIELDS:
        t = getattr(out, field, None)
        if field not in wanted:
            if t is not None:
                broke(f"{field} was not requested and must be None")
            continue
        width = _width(call, field)
        shape = (n,) if width is None else (n, width)
        dtype = torch.int64 if field in _ID_FIELDS else torch.float32
        want = f"{str(dtype).removeprefix('torch.')} {list(shape)} on {device}"
        if not isinstance(t, torch.Tensor):
            broke(f"{field} was requested and must be a {want} tensor, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != shape or t.device != device:
            broke(f"{field} must be {want}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if field not in _ID_FIELDS and needs_grad and not t.requires_grad:
            broke(
                f"{field} does not require grad although hidden or weight does: the backend "
                "detached it, so no gradient would reach the model"
            )
        if field not in _ID_FIELDS and graph and needs_grad:
            breach = graph_breach(field, t, {"hidden": call.hidden, "weight": call.weight})
            if breach is not None:
                broke(breach)


def _shaped(
    t: torch.Tensor | None, shape: tuple[int, ...], tail: int | None
) -> torch.Tensor | None:
    """``t`` in the labels' shape (plus its last dimension), never as a view."""
    if t is None:
        return None
    full = shape if tail is None else (*shape, tail)
    return t if tuple(t.shape) == full else t.reshape(full).clone()


def shaped_extras(call: HeadCall, out: HeadOutput, shape: tuple[int, ...]) -> dict[str, Any]:
    """The extra fields of ``out`` in the labels' shape, for ``FusedHeadOutput`` (checked before)."""
    if call.outputs <= _BASIC:
        return {}
    result: dict[str, Any] = {}
    for field in EXTRA_FIELDS:
        t = getattr(out, field)
        result[field] = None if t is None else _shaped(t, shape, _width(call, field))
    return result


def empty_extras(call: HeadCall, shape: tuple[int, ...], zero: torch.Tensor) -> dict[str, Any]:
    """N = 0: the requested extras as empty tensors (float ones attached to the graph like ``zero``)."""
    wanted = {f for o in call.outputs for f in OUTPUT_FIELDS.get(o, ())}
    result: dict[str, Any] = {}
    for field in EXTRA_FIELDS:
        if field not in wanted:
            result[field] = None
            continue
        width = _width(call, field)
        full = shape if width is None else (*shape, width)
        if field in _ID_FIELDS:
            result[field] = torch.empty(full, dtype=torch.int64, device=zero.device)
        else:
            base = zero.reshape(*shape, *(() if width is None else (1,)))
            result[field] = base.expand(full).clone()
    return result


def check_kl(
    out: object,
    n: int,
    device: torch.device,
    needs_grad: bool,
    broke: Callable[[str], NoReturn],
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """A backend's ``kl()`` result: a ``KLOutput`` holding a float32 ``[N]`` tensor on the device;
    with ``inputs`` (eager, gradients recorded) one whose graph reaches each of them."""
    if not isinstance(out, KLOutput):
        broke(f"kl() must return a fusedhead.protocol.KLOutput, got {type(out).__name__}")
    t = out.kl
    if not isinstance(t, torch.Tensor):
        broke(f"kl must be a float32 [{n}] tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or tuple(t.shape) != (n,) or t.device != device:
        broke(f"kl must be float32 [{n}] on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if needs_grad and not t.requires_grad:
        broke(
            "kl does not require grad although hidden or weight does: the backend detached it, "
            "so no gradient would reach the student"
        )
    if needs_grad and inputs is not None:
        breach = graph_breach("kl", t, inputs)
        if breach is not None:
            broke(breach)
