"""What every custom-op pair of this backend shares: a forward op and its backward op registered
together (fakes, autograd), and the refusal of a double backward.

Each pair (``ops.head_forward``, ``kl.kl_forward``, ``outputs.head_outputs``) is registered by
``register_pair``: ``torch.compile`` with ``fullgraph=True`` and CUDA-graph capture see two
opaque ops with fake-tensor shapes. No backward is differentiable: a double backward raises,
never returning a silently first-order gradient.
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as types.

from collections.abc import Callable
from typing import Any

import torch

DOUBLE_BACKWARD = (
    "the triton backend's backward is not differentiable: a double backward "
    "(create_graph=True, e.g. a gradient penalty through the log-probs) is not supported, nor "
    "on the torch backend; form such a term from full logits (hidden @ weight.T) with plain "
    "PyTorch ops"
)


def refuse_double_backward(ctx: Any, *grads: Any) -> Any:
    """The registered backward of every backward op: it raises (see the module docstring)."""
    raise RuntimeError(DOUBLE_BACKWARD)


def _no_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    """A backward op saves nothing: its own backward only raises."""


def grads_or_empty(
    hidden: torch.Tensor, weight: torch.Tensor, dh: torch.Tensor | None, dw: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A backward op's (dh, dW): an empty tensor for a gradient not asked (ops return tensors)."""
    return (
        hidden.new_empty(0) if dh is None else dh,
        weight.new_empty(0) if dw is None else dw,
    )


def backward_fake(
    hidden: torch.Tensor, weight: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, ...]:
    """Fake (dh, dW) of any backward op taking ``(hidden, weight, ..., need_dh, need_dw)``."""
    need_dh, need_dw = args[-2], args[-1]
    return (
        torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
        torch.empty_like(weight) if need_dw else weight.new_empty(0),
    )


def register_pair(
    forward: Any,
    backward: Any,
    *,
    forward_fake: Callable[..., Any],
    setup_context: Callable[..., None],
    gradient: Callable[..., tuple[Any, ...]],
) -> None:
    """Register a custom-op pair: ``forward``'s fake and autograd (``setup_context`` saves what
    ``gradient`` reads; ``gradient`` calls the ``backward`` op), and ``backward``'s fake and its
    autograd, which refuses a double backward."""
    forward.register_fake(forward_fake)
    backward.register_fake(backward_fake)
    torch.library.register_autograd(forward, gradient, setup_context=setup_context)
    torch.library.register_autograd(backward, refuse_double_backward, setup_context=_no_setup)
