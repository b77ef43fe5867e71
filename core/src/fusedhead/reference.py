"""The plain full-logits computation: the yardstick for tests, the conformance kit and bench.

It materialises ``[N, V]`` logits on purpose and differentiates through autograd, so it is
obviously right and obviously memory-hungry. Compute in float64 to measure other backends.
"""

from __future__ import annotations

import itertools
import math

import torch


def reference_fused_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    softcap: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and entropy of each row from full logits, in ``compute_dtype``.

    ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]``; ``temperature`` a float or a tensor
    broadcastable to ``labels``; ``softcap`` applies ``c * tanh(z / c)`` before the temperature
    division. Out-of-range labels (not ``ignore_index``) give NaN. Outputs have the shape of
    ``labels`` and dtype ``compute_dtype`` (a floating dtype; default: the input dtype promoted to
    at least fp32). Ignored rows give 0 and no gradient, whatever their hidden state or
    temperature holds (NaN included): they are selected out before the matmul, never multiplied
    by 0. Arguments are checked as ``fused_head`` checks them, by name.
    """
    ignore_index, return_entropy = _check(
        hidden, weight, labels, temperature, ignore_index, return_entropy, softcap, compute_dtype
    )
    dtype = compute_dtype or torch.promote_types(hidden.dtype, torch.float32)
    labels = labels.long()
    valid = labels != ignore_index
    h = torch.where(valid.unsqueeze(-1), hidden.to(dtype), torch.zeros((), dtype=dtype))
    w = weight.to(dtype)
    z = h @ w.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(dtype).expand(labels.shape)
        z = z / torch.where(valid, t, torch.ones((), dtype=dtype)).unsqueeze(-1)
    else:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    in_range = (labels >= 0) & (labels < z.shape[-1])
    safe = torch.where(valid & in_range, labels, torch.zeros_like(labels)).long()
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=dtype, device=z.device)
    logp = torch.where(valid, logp, zero)
    logp = torch.where(valid & ~in_range, torch.full_like(logp, float("nan")), logp)
    if not return_entropy:
        return logp, None
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ent = torch.where(valid, ent, zero)
    return logp, ent


def _check(
    hidden: object,
    weight: object,
    labels: object,
    temperature: object,
    ignore_index: object,
    return_entropy: object,
    softcap: object,
    compute_dtype: object,
) -> tuple[int, bool]:
    """The arguments' types, shapes, devices and scalars, named as ``fused_head`` names them (any
    floating dtype is taken: this is the yardstick); ``ignore_index`` and ``return_entropy`` as
    an int and a bool."""
    from fusedhead.checks import (
        INT64_MAX,
        INT64_MIN,
        INT_DTYPES,
        flag_arg,
        integer,
        not_int64_exact,
        per_token_rank,
        positive_float,
        tensor_arg,
    )

    h, w, y = (
        tensor_arg("hidden", hidden),
        tensor_arg("weight", weight),
        tensor_arg("labels", labels),
    )
    for arg, t in (("hidden", h), ("weight", w)):
        if not t.is_floating_point():
            raise TypeError(f"{arg} must be a floating-point tensor, got dtype {t.dtype}")
    index = integer("ignore_index", ignore_index, "an int")
    if not INT64_MIN <= index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {index}")
    entropy = flag_arg("return_entropy", return_entropy)
    if compute_dtype is not None and not (
        isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
    ):
        raise TypeError(
            "compute_dtype must be a floating torch.dtype (torch.float64, torch.float32, ...) or "
            f"None, got {type(compute_dtype).__name__} {compute_dtype!r}"
        )
    if w.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got shape {tuple(w.shape)}")
    if h.dim() == 0 or h.shape[-1] != w.shape[1]:
        raise ValueError(
            f"hidden must have shape [..., H] with weight's H={w.shape[1]}, got shape {tuple(h.shape)}"
        )
    if tuple(y.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(h.shape[:-1])}, got {tuple(y.shape)}"
        )
    if y.dtype not in INT_DTYPES:
        not_int64_exact("labels", y.dtype)
    if not isinstance(temperature, torch.Tensor):
        positive_float("temperature", temperature)
    else:
        tensor_arg("temperature", temperature)
        if not temperature.is_floating_point():
            raise TypeError(
                f"temperature tensor must be floating point, got dtype {temperature.dtype}"
            )
        if temperature.device != h.device:
            raise ValueError(
                f"temperature tensor must be on hidden's device {h.device}, got "
                f"{temperature.device}"
            )
        per_token_rank("temperature", temperature, tuple(y.shape), "temperature tensor")
        try:
            temperature.expand(y.shape)
        except RuntimeError:
            raise ValueError(
                f"temperature tensor of shape {tuple(temperature.shape)} must broadcast to the "
                f"labels' shape {tuple(y.shape)}"
            ) from None
    for arg, t in (("weight", w), ("labels", y)):
        if t.device != h.device:
            raise ValueError(f"{arg} must be on hidden's device {h.device}, got {t.device}")
    if softcap is not None:
        positive_float("softcap", softcap)
    return index, entropy


def reference_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    aggregation: str = "token-mean",
    loss_normalizer: float | None = None,
    horizon: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """verl's policy loss (``compute_policy_loss_vanilla``, ``kl_penalty``, ``agg_loss``) written
    out plainly over full logits, differentiable through autograd: the yardstick of
    ``fused_policy_loss``. Sequences are the rows of ``labels [..., S]``, or ``cu_seqlens``'s."""
    logp, ent = reference_fused_head(
        hidden,
        weight,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        softcap=softcap,
        compute_dtype=compute_dtype,
    )
    assert ent is not None
    return policy_loss_from_log_probs(
        logp,
        ent,
        labels,
        old_log_probs=old_log_probs,
        advantages=advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        entropy_coef=entropy_coef,
        ref_log_probs=ref_log_probs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        rollout_log_probs=rollout_log_probs,
        tis_cap=tis_cap,
        aggregation=aggregation,
        loss_normalizer=loss_normalizer,
        horizon=horizon,
        cu_seqlens=cu_seqlens,
        ignore_index=ignore_index,
    )


def policy_loss_from_log_probs(
    logp: torch.Tensor,
    ent: torch.Tensor,
    labels: torch.Tensor,
    *,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    aggregation: str = "token-mean",
    loss_normalizer: float | None = None,
    horizon: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """verl's policy loss from per-token log-probs ``logp`` and entropies ``ent`` (labels' shape),
    differentiable in both: ``reference_policy_loss`` after its head, and the loss the four-GEMM
    paths (a head's log-probs, then the loss in torch) compute. Computes in ``logp``'s dtype."""
    _check_loss_scalars(
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        entropy_coef=entropy_coef,
        kl_coef=kl_coef,
        tis_cap=tis_cap,
        loss_normalizer=loss_normalizer,
        horizon=horizon,
        ignore_index=ignore_index,
    )
    _check_loss_arguments(
        labels,
        old_log_probs=old_log_probs,
        advantages=advantages,
        ref_log_probs=ref_log_probs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        rollout_log_probs=rollout_log_probs,
        tis_cap=tis_cap,
        aggregation=aggregation,
        horizon=horizon,
        cu_seqlens=cu_seqlens,
    )
    dtype = logp.dtype
    mask = labels != ignore_index
    # None: on-policy, the old policy is the current one (TRL's and verl's lp.detach())
    old = logp.detach() if old_log_probs is None else old_log_probs.to(dtype).expand(labels.shape)
    adv = torch.where(mask, advantages.to(dtype).expand(labels.shape), 0)
    log_ratio = torch.clamp(torch.where(mask, logp - old, 0), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.min(-adv * dual_clip, pg), pg)
    if rollout_log_probs is not None:
        assert tis_cap is not None
        log_ratio = old - rollout_log_probs.to(dtype).expand(labels.shape)
        # verl's +-20 bound; -inf (a +inf rollout log-prob, a masked token) stays a weight of 0
        log_ratio = torch.where(torch.isneginf(log_ratio), log_ratio, log_ratio.clamp(-20.0, 20.0))
        tis = torch.exp(log_ratio).clamp(max=tis_cap)
        pg = pg * torch.where(mask, tis, 0).detach()
    terms = [pg]
    coefs = [1.0]
    if entropy_coef:
        terms.append(ent)
        coefs.append(-entropy_coef)
    if kl_coef:
        assert ref_log_probs is not None
        ref = torch.where(mask, ref_log_probs.to(dtype).expand(labels.shape), 0)
        lp = torch.where(mask, logp, 0)
        kl = _kl_penalty(str(kl_estimator), lp, ref)
        terms.append(kl)
        coefs.append(kl_coef)
    parts = [
        coef * _aggregate(mat, mask, aggregation, loss_normalizer, cu_seqlens, horizon)
        for coef, mat in zip(coefs, terms, strict=True)
    ]
    return torch.stack(parts).sum()


def _kl_penalty(estimator: str, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """verl's ``kl_penalty`` (and TRL's unclamped k3), differentiable through autograd: a ``+``
    form is verl's straight-through estimate, the value of its base with k2's gradient."""
    if estimator.endswith("+"):
        k2 = 0.5 * (lp - ref).square()
        return k2 - k2.detach() + _kl_penalty(estimator[:-1], lp, ref).detach()
    if estimator in ("k1", "kl"):
        return lp - ref
    if estimator == "abs":
        return (lp - ref).abs()
    if estimator in ("k2", "mse"):
        return 0.5 * (lp - ref).square()
    if estimator == "k3-unclamped":
        d = ref - lp
        return torch.exp(d) - d - 1
    d = torch.clamp(ref - lp, min=-20, max=20)  # k3, verl's low_var_kl
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


def _check_loss_arguments(
    labels: torch.Tensor,
    *,
    old_log_probs: object,
    advantages: object,
    ref_log_probs: object,
    kl_coef: float,
    kl_estimator: object,
    rollout_log_probs: object,
    tis_cap: object,
    aggregation: object,
    horizon: object,
    cu_seqlens: object,
) -> None:
    """The loss's own arguments, named as ``fused_policy_loss`` names them: an unknown
    ``aggregation`` or ``kl_estimator`` was computed as another one, a per-token tensor of another
    shape raised torch's expand error, a missing partner tensor an AssertionError."""
    from fusedhead.checks import (
        packed_per_sequence,
        per_token_shape,
        sequences_marked,
        tensor_arg,
    )
    from fusedhead.protocol import AGGREGATIONS, KL_ESTIMATORS

    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")
    estimators = (*KL_ESTIMATORS, "kl", "mse", "low_var_kl", "kl+", "k2+", "mse+", "low_var_kl+")
    if kl_estimator not in estimators:
        raise ValueError(f"kl_estimator must be one of {list(estimators)}, got {kl_estimator!r}")
    if kl_coef and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef!r} needs ref_log_probs; pass them, or kl_coef=0.0")
    if horizon is not None and aggregation != "seq-mean-token-sum-norm":
        raise ValueError(
            f"horizon={horizon!r} is the length seq-mean-token-sum-norm divides by; "
            f"aggregation={aggregation!r} divides by none"
        )
    sequences_marked(aggregation, tuple(labels.shape), cu_seqlens)
    if (rollout_log_probs is None) != (tis_cap is None):
        raise ValueError(
            "truncated importance sampling needs both rollout_log_probs and tis_cap, got "
            f"{'rollout_log_probs' if tis_cap is None else 'tis_cap'} alone"
        )
    shape = tuple(labels.shape)
    for arg, value in (
        ("old_log_probs", old_log_probs),
        ("advantages", advantages),
        ("ref_log_probs", ref_log_probs),
        ("rollout_log_probs", rollout_log_probs),
    ):
        if value is None and arg != "advantages":
            continue
        t = tensor_arg(arg, value)
        if not t.is_floating_point():
            raise TypeError(
                f"{arg} must be a floating tensor (fp32, fp64, fp16, bf16), got {t.dtype}"
            )
        if t.device != labels.device:
            raise ValueError(f"{arg} must be on the labels' device {labels.device}, got {t.device}")
        if arg == "advantages" and cu_seqlens is not None:
            packed_per_sequence(arg, t, cu_seqlens, shape)
        per_token_shape(arg, t, shape, per_sequence=arg == "advantages")
    if cu_seqlens is not None:
        cu = tensor_arg("cu_seqlens", cu_seqlens)
        n = labels.numel()
        bounds = cu.tolist() if cu.dim() == 1 and not cu.is_floating_point() else None
        if (
            bounds is None
            or len(bounds) < 2
            or bounds[0] != 0
            or bounds[-1] != n
            or any(a > b for a, b in itertools.pairwise(bounds))
        ):
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor that starts at 0, never decreases and "
                f"ends at the {n} tokens, got {cu.dtype} {cu.tolist() if cu.numel() <= 12 else tuple(cu.shape)}"
            )


def _check_loss_scalars(
    *,
    clip_low: object,
    clip_high: object,
    dual_clip: object,
    entropy_coef: object,
    kl_coef: object,
    tis_cap: object,
    loss_normalizer: object,
    horizon: object,
    ignore_index: object,
) -> None:
    """The loss's numbers in the ranges ``fused_policy_loss`` takes, named as it names them:
    before, a str or None raised Python's operand TypeError, and NaN gave a NaN loss."""
    from fusedhead.checks import (
        COUNT_FLOOR,
        COUNT_TEXT,
        INT64_MAX,
        INT64_MIN,
        check_clip_low,
        integer,
        one_element_real,
        real_in,
    )
    from fusedhead.protocol import TIS_CAP_FLOOR, TIS_CAP_TEXT

    check_clip_low("clip_low", clip_low)
    real_in("clip_high", clip_high, low=0.0, what="a finite float >= 0")
    if dual_clip is not None:
        what = "a finite float > 1 (verl's clip_ratio_c)"
        if real_in("dual_clip", dual_clip, low=1.0, what=what) == 1.0:
            raise ValueError(f"dual_clip must be {what}, got {dual_clip!r}")
    real_in("entropy_coef", entropy_coef, low=-math.inf, what="a finite float")
    real_in("kl_coef", kl_coef, low=0.0, what="a finite float >= 0")
    if tis_cap is not None:
        real_in("tis_cap", tis_cap, low=TIS_CAP_FLOOR, what=TIS_CAP_TEXT)
    if isinstance(loss_normalizer, torch.Tensor):
        one_element_real("loss_normalizer", loss_normalizer)
        value = float(loss_normalizer)  # a reference reads it: its value is checked as a float's
        real_in("loss_normalizer", value, low=COUNT_FLOOR, what=f"a count > 0, {COUNT_TEXT}")
    elif loss_normalizer is not None:
        real_in(
            "loss_normalizer", loss_normalizer, low=COUNT_FLOOR, what=f"a count > 0, {COUNT_TEXT}"
        )
    if horizon is not None:
        real_in("horizon", horizon, low=COUNT_FLOOR, what=f"a length > 0, {COUNT_TEXT}")
    index = integer("ignore_index", ignore_index, "an int")
    if not INT64_MIN <= index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {index}")


def _aggregate(
    mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    normalizer: float | None,
    cu_seqlens: torch.Tensor | None,
    horizon: float | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss`` over the sequences (rows, or ``cu_seqlens``'s spans); ``horizon``:
    the norm mode's divisor (default the longest sequence, verl's padded width for rows)."""
    flat, fmask = mat.reshape(-1), mask.reshape(-1)
    masked = torch.where(fmask, flat, 0)
    if mode == "token-mean":  # no scored token: 0, as the fused call gives (not 0 / 0)
        return masked.sum() / (fmask.sum().clamp_min(1) if normalizer is None else normalizer)
    if flat.numel() == 0:  # [B, 0] labels: no sequence has a token
        return masked.sum() * 0
    if cu_seqlens is None:
        width = mat.shape[-1] if mat.dim() else 1
        bounds = list(range(0, flat.numel() + 1, width))
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
    if horizon is None:
        horizon = max(b - a for a, b in itertools.pairwise(bounds))
    seq_losses, active = [], 0
    for a, b in itertools.pairwise(bounds):
        count = int(fmask[a:b].sum())
        if count == 0:
            continue
        active += 1
        part = masked[a:b].sum()
        seq_losses.append(part / count if mode == "seq-mean-token-mean" else part)
    seqs = active if normalizer is None else normalizer
    out = torch.stack(seq_losses).sum() / seqs if seq_losses else masked.sum() * 0
    return out / horizon if mode == "seq-mean-token-sum-norm" else out
