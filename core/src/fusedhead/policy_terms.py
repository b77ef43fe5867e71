"""The policy loss per token and its derivative in the row's log-prob and entropy (verl's
``core_algos`` semantics), written once for the core and every backend.

Every term is elementwise in the token, so a backend that knows a row's log-prob ``lp`` and
entropy ``H`` knows ``dL/dlp`` and ``dL/dH`` at once and can form the logits' gradient in the same
pass (docs/policy-loss.md). The derivatives are those torch's autograd gives for verl's formulas
(clamps pass the gradient on their closed range, ties of a max or min split it), written out so
that a ``[chunk]`` slice costs a few elementwise ops and no graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusedhead.protocol import PolicyLossCall

#: verl clamps the log-ratio (and the k3 KL's log-ratio) to this range before ``exp``.
LOG_RATIO_BOUND = 20.0
#: verl clamps the k3 KL estimate to ``[-KL_BOUND, KL_BOUND]``.
KL_BOUND = 10.0


class TokenTerms(NamedTuple):
    """fp32 ``[M]`` tensors of a slice of rows, 0 on ignored rows.

    ``loss``: each token's weighted term (the loss is their sum); ``grad_log_probs`` and
    ``grad_entropy``: the loss's derivative in the token's log-prob and entropy.
    """

    loss: torch.Tensor
    grad_log_probs: torch.Tensor
    grad_entropy: torch.Tensor


def on_policy_log_ratio(log_probs: torch.Tensor) -> torch.Tensor:
    """``lp - lp.detach()`` on-policy: 0, and NaN where ``lp`` is (an unchecked call's
    out-of-range label), so such a row makes the loss NaN, not a finite value without it."""
    return torch.where(torch.isnan(log_probs), log_probs, torch.zeros_like(log_probs))


def _clamped(x: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``clamp(x, -bound, bound)`` and where its derivative is 1 (the closed range)."""
    return x.clamp(-bound, bound), (x >= -bound) & (x <= bound)


def _max_grad(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    """The derivative of ``maximum(a, b)``: the larger's, half each on a tie (as autograd)."""
    return torch.where(a > b, da, torch.where(a < b, db, (da + db) * 0.5))


def surrogate(
    call: PolicyLossCall, rows: slice, log_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped (dual-clipped, TIS-weighted) surrogate of each token and its derivative."""
    adv = call.advantages[rows]
    if call.old_log_probs is None:  # on-policy: exp(lp - lp.detach()), exactly 1 with slope 1
        log_ratio = on_policy_log_ratio(log_probs)
        live = torch.ones_like(log_probs, dtype=torch.bool)
    else:
        log_ratio, live = _clamped(log_probs - call.old_log_probs[rows], LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    d_ratio = torch.where(live, ratio, torch.zeros_like(ratio))
    lo, hi = 1.0 - call.clip_low, 1.0 + call.clip_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(lo, hi)
    d_unclipped = -adv * d_ratio
    d_clipped = torch.where((ratio >= lo) & (ratio <= hi), d_unclipped, torch.zeros_like(ratio))
    loss = torch.maximum(unclipped, clipped)
    grad = _max_grad(unclipped, clipped, d_unclipped, d_clipped)
    if call.dual_clip is not None:
        floor = -adv * call.dual_clip
        # min(floor, loss) = -max(-floor, -loss): the same tie rule.
        dual_grad = -_max_grad(-floor, -loss, torch.zeros_like(grad), -grad)
        negative = adv < 0
        loss = torch.where(negative, torch.minimum(floor, loss), loss)
        grad = torch.where(negative, dual_grad, grad)
    if call.tis_weight is not None:
        tis = call.tis_weight[rows]
        loss, grad = loss * tis, grad * tis
    return loss, grad


def kl_penalty(
    estimator: str, log_probs: torch.Tensor, ref_log_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token KL estimate against the reference policy and its derivative in ``lp``
    (``protocol.KL_ESTIMATORS``; a ``+`` form is its value with k2's gradient, as verl's)."""
    diff = log_probs - ref_log_probs
    if estimator.endswith("+"):
        return kl_penalty(estimator[:-1], log_probs, ref_log_probs)[0], diff
    if estimator == "k1":
        return diff, torch.ones_like(diff)
    if estimator == "k2":
        return 0.5 * diff.square(), diff
    if estimator == "abs":  # torch's abs: slope 0 at 0
        return diff.abs(), torch.sign(diff)
    if estimator == "k3-unclamped":  # TRL's: d = ref - lp; exp(d) - d - 1
        e = torch.exp(-diff)
        return e + diff - 1.0, 1.0 - e
    # k3 (verl's low_var_kl): d = ref - lp, clamped; exp(d) - d - 1, clamped.
    d, live_d = _clamped(-diff, LOG_RATIO_BOUND)
    e = torch.exp(d)
    raw = e - d - 1.0
    kl, live_kl = _clamped(raw, KL_BOUND)
    grad = torch.where(live_d & live_kl, 1.0 - e, torch.zeros_like(e))
    return kl, grad


def label_logit_grad(
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> torch.Tensor:
    """``dL/dz`` at each row's label column (before ``1 / T`` and a softcap's chain factor):
    ``g_lp (1 - p) - g_H p (log p + H)``, with ``1 - p = -expm1(log p)`` from the row's log-prob,
    so a confident token's ``1 - p`` keeps its digits (a tile's ``p`` carries ``lse``'s rounding)."""
    p = torch.exp(log_probs)
    return grad_log_probs * -torch.expm1(log_probs) - grad_entropy * p * (log_probs + entropy)


def token_grads(
    call: PolicyLossCall,
    start: int,
    stop: int,
    log_probs: torch.Tensor,
    entropy: torch.Tensor,
) -> TokenTerms:
    """The weighted loss terms of rows ``[start, stop)`` and their derivatives, from the rows'
    fp32 log-probs and entropies. Ignored rows (weight 0) give exact zeros whatever their values."""
    rows = slice(start, stop)
    weight = call.token_weight[rows]
    valid = weight != 0
    zero = torch.zeros((), dtype=torch.float32, device=weight.device)
    lp = torch.where(valid, log_probs.float(), zero)
    ent = torch.where(valid, entropy.float(), zero)
    loss, d_lp = surrogate(call, rows, lp)
    if call.entropy_coef:
        loss = loss - call.entropy_coef * ent
    if call.kl_coef:
        assert call.ref_log_probs is not None
        kl, d_kl = kl_penalty(call.kl_estimator, lp, call.ref_log_probs[rows])
        loss = loss + call.kl_coef * kl
        d_lp = d_lp + call.kl_coef * d_kl
    d_ent = torch.full_like(weight, -call.entropy_coef)
    return TokenTerms(
        torch.where(valid, loss * weight, zero),
        torch.where(valid, d_lp * weight, zero),
        torch.where(valid, d_ent * weight, zero),
    )
