"""What a policy-loss call returns: ``PolicyLossOutput``, the loss formed from the backend's
statistics with the forward's gradients attached for ``loss.backward()``, and the metrics.

Apart from the call path (``policy.run``): the loss's forming and its backward, not its checks.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.utils._pytree as pytree

from fusedhead.policy_grads import AttachedGradients
from fusedhead.policy_terms import LOG_RATIO_BOUND, kl_penalty, on_policy_log_ratio, token_grads
from fusedhead.protocol import PolicyLossCall, PolicyLossResult


@dataclass(frozen=True)
class PolicyLossOutput:
    """The policy loss of a batch, its per-token statistics and the metrics trainers log.

    ``loss``: fp32 scalar, differentiable in hidden and weight only (its gradients were computed
    in the forward; one ``backward`` per loss). ``log_probs`` and ``entropy``: detached fp32 in the
    labels' shape, 0 at ignored rows. The metrics are detached fp32 scalars on the device (no host
    sync): ``pg_loss`` (the aggregated surrogate), ``entropy_loss`` (the aggregated entropy, as verl
    names it), ``kl`` (the aggregated KL estimate; None without ``ref_log_probs``), and as masked
    token means ``clip_fraction`` (verl's ``pg_clipfrac``), ``clip_fraction_lower`` (the dual clip's;
    None without it), ``approx_kl`` (verl's ``ppo_kl``, against the old policy) and the ratio's mean,
    min and max.
    """

    loss: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    pg_loss: torch.Tensor
    entropy_loss: torch.Tensor
    kl: torch.Tensor | None
    clip_fraction: torch.Tensor
    clip_fraction_lower: torch.Tensor | None
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        """The metrics by name (those that are set), for a trainer's logger."""
        names = (
            "pg_loss",
            "entropy_loss",
            "kl",
            "clip_fraction",
            "clip_fraction_lower",
            "approx_kl",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
        )
        return {k: v for k in names if (v := getattr(self, k)) is not None}


_FIELDS = tuple(f.name for f in fields(PolicyLossOutput))


def _flatten(out: PolicyLossOutput) -> tuple[list[torch.Tensor | None], tuple[str, ...]]:
    return [getattr(out, name) for name in _FIELDS], _FIELDS


def _unflatten(values: Iterable[Any], names: tuple[str, ...]) -> PolicyLossOutput:
    return PolicyLossOutput(**dict(zip(names, values, strict=True)))


# A pytree node, as transformers registers its ModelOutput: DDP(static_graph=True) finds a
# module's output tensors by tree_flatten, and an opaque output kept it from ever all-reducing.
pytree.register_pytree_node(
    PolicyLossOutput, _flatten, _unflatten, serialized_type_name="fusedhead.PolicyLossOutput"
)


def output(
    call: PolicyLossCall,
    result: PolicyLossResult,
    shape: tuple[int, ...],
) -> PolicyLossOutput:
    """The loss formed from the backend's statistics, its gradients attached, and the metrics."""
    lp, ent = result.log_probs.detach(), result.entropy.detach()
    n = lp.shape[0]
    terms = token_grads(call, 0, n, lp, ent)
    loss = terms.loss.sum()
    h, w = call.head.hidden, call.head.weight
    if call.need_hidden_grad or call.need_weight_grad:
        loss = _attach(h, w, loss, result.grad_hidden, result.grad_weight)
    weight = call.token_weight
    valid = weight != 0
    zero = torch.zeros((), dtype=torch.float32, device=lp.device)
    count = valid.sum().to(torch.float32)
    denom = count.clamp(min=1.0)
    if call.old_log_probs is None:  # on-policy: ratio 1 (NaN where lp is), as token_grads has it
        log_ratio = on_policy_log_ratio(lp)
    else:
        log_ratio = (lp - call.old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_ratio = torch.where(valid, log_ratio, zero)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, call.advantages, zero)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - call.clip_low, 1.0 + call.clip_high)
    surrogate = torch.maximum(unclipped, clipped)
    lower = None
    if call.dual_clip is not None:
        floor = -adv * call.dual_clip
        lower = ((surrogate > floor) & (adv < 0) & valid).sum() / denom
        surrogate = torch.where(adv < 0, torch.minimum(floor, surrogate), surrogate)
    if call.tis_weight is not None:
        surrogate = surrogate * torch.where(valid, call.tis_weight, zero)
    kl = None
    ref = call.ref_log_probs
    if ref is not None:
        lp_valid = torch.where(valid, lp, zero)
        kl_tok, _ = kl_penalty(call.kl_estimator, lp_valid, torch.where(valid, ref, zero))
        kl = (kl_tok * weight).sum()
    big = torch.full((1,), math.inf, device=lp.device)
    # The extremes over scored rows; with none, min/max's identities (+inf, -inf), so that a
    # min or max across micro-batches or ranks (all_reduce MIN/MAX) stays right.
    ratio_min = torch.cat((torch.where(valid, ratio, big), big)).amin()
    ratio_max = torch.cat((torch.where(valid, ratio, -big), -big)).amax()
    return PolicyLossOutput(
        loss=loss,
        log_probs=_shaped(lp, shape),
        entropy=_shaped(ent, shape),
        pg_loss=(surrogate * weight).sum(),
        entropy_loss=(torch.where(valid, ent, zero) * weight).sum(),
        kl=kl,
        clip_fraction=((clipped > unclipped) & valid).sum() / denom,
        clip_fraction_lower=lower,
        approx_kl=(-log_ratio).sum() / denom,
        ratio_mean=torch.where(valid, ratio, zero).sum() / denom,
        ratio_min=ratio_min,
        ratio_max=ratio_max,
    )


def _shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t if tuple(t.shape) == shape else t.reshape(shape).clone()


def _attach(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    loss: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """``AttachedGradients.apply``, never traced where Dynamo is loaded (``fusedhead.untraced``):
    Dynamo would trace the backward too, and break its graph at the scale's host read."""
    if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
        from fusedhead.untraced import attach_gradients

        return attach_gradients(hidden, weight, loss, grad_hidden, grad_weight)
    out: torch.Tensor = AttachedGradients.apply(hidden, weight, loss, grad_hidden, grad_weight)  # type: ignore[no-untyped-call]
    return out
