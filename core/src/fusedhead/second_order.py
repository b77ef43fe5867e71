"""A backward that is not differentiable, refused by name when a gradient of it is asked for.

``torch.autograd.function.once_differentiable`` hangs its refusal on detached copies of the
gradients, so autograd only meets it on a ``backward()`` that walks everything: asked for the
gradient of chosen inputs (``torch.autograd.grad(penalty, [hidden])``), the engine prunes the
detached node and the second-order term is silently dropped (or torch says the input "appears to
not have been used in the graph"). Here the refusal node is tied to the inputs the first-order
gradients belong to (``hidden``, ``weight``) and to the incoming gradients, so every path that
differentiates the gradients again, however it is asked for, reaches it and raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

_Backward = Callable[..., Any]


class _Refuse(torch.autograd.Function):
    """Identity on the first ``count`` tensors; its backward raises ``message``."""

    @staticmethod
    def forward(ctx: Any, message: str, count: int, *tensors: torch.Tensor) -> tuple[Any, ...]:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        raise RuntimeError(ctx.message)


def refuse_second_order(
    grads: tuple[Any, ...], anchors: Iterable[Any], message: str
) -> tuple[Any, ...]:
    """``grads`` as they are, each tensor attached to a node that raises ``message`` when it is
    differentiated; ``anchors`` (the tensors the gradients belong to, and the incoming gradients)
    are its inputs, so a second-order gradient asked for any of them, or anything behind them,
    reaches it. Without grad mode (no ``create_graph``) ``grads`` come back untouched."""
    if not torch.is_grad_enabled():
        return grads
    slots = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    ties = [a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad]
    if not slots or not ties:
        return grads
    attached = _Refuse.apply(message, len(slots), *(grads[i] for i in slots), *ties)  # type: ignore[no-untyped-call]
    result = list(grads)
    for i, t in zip(slots, attached, strict=True):
        result[i] = t
    return tuple(result)


def first_order(message: str) -> Callable[[_Backward], _Backward]:
    """Decorates an ``autograd.Function.backward``: it runs without grad, and under
    ``create_graph=True`` its gradients come back through ``refuse_second_order``, tied to the
    Function's saved tensors and the incoming gradients (save the inputs the gradients are for)."""

    def decorate(backward: _Backward) -> _Backward:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return backward(ctx, *grads)
            with torch.no_grad():
                out = backward(ctx, *grads)
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            anchors = [*ctx.saved_tensors, *grads]
            tied = refuse_second_order(outs, anchors, message)
            return tied[0] if single else tied

        return wrapper

    return decorate
