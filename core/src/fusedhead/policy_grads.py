"""The autograd node of the fused policy loss: its backward hands out the gradients the forward
computed, scaled by the upstream gradient, once."""

from __future__ import annotations

import math
from typing import Any

import torch


class AttachedGradients(torch.autograd.Function):
    """The loss as a node whose backward hands out the gradients the forward computed."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        loss: torch.Tensor,
        grad_hidden: torch.Tensor | None,
        grad_weight: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.grads = (grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fused_policy_loss: the loss's gradients are computed in the forward and are not "
                "differentiable again (create_graph=True, e.g. a gradient penalty through the loss); "
                "use fused_head's log-probs and write the loss in torch for higher-order gradients"
            )
        if ctx.grads is None:
            raise RuntimeError(
                "fused_policy_loss: a second backward through one loss (retain_graph=True or a "
                "loss reused across steps); its gradients were handed out by the first backward: "
                "compute the loss again for another backward"
            )
        stored = ctx.grads
        ctx.grads = None  # handed out once; the stored gradients are scaled in place
        _scale_([g for g in stored if g is not None], grad)
        # an fp32 gradient of an fp16 input (``PolicyLossResult``) rounded once, after its scale
        grad_hidden, grad_weight = (
            g if g is None or g.dtype == dtype else g.to(dtype)
            for g, dtype in zip(stored, ctx.dtypes, strict=True)
        )
        return grad_hidden, grad_weight, None, None, None


def _scale_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """``grads *= scale`` in place, nothing to do for a scale of 1 (``loss.backward()``).

    The scale is read on the host, once per backward (as Liger's fused cross-entropy does): a
    Python scale keeps the multiply one pass in fp32 arithmetic, rounded once, where a bf16
    ``mul_`` by an fp32 0-d tensor takes a slow mixed-dtype kernel (2.4 ms for a 1.2 GiB weight
    gradient on an H200), and the usual scale of 1 costs nothing. Not ``_foreach_mul_``: on the
    CPU it rounds the scale to the gradients' dtype first (fp16: 65536, a GradScaler's first
    scale, is inf, and a zero gradient times inf is NaN; bf16: 1/3 is off by 0.2 %).
    """
    value = float(scale)
    if not math.isfinite(value):  # an Inf or NaN scale: a zero (an ignored row's) stays 0
        for g in grads:
            torch.where(g == 0, g, g * value, out=g)
    elif value != 1.0:
        for g in grads:
            g.mul_(value)
