"""The policy loss's own arguments checked and flattened into a ``PolicyLossCall`` (the aggregation
as one weight per token), and other trainers' names for them told apart.

Kept apart from the call path (``policy.run`` calls ``policy_call`` once): the arguments' checks and
their messages are most of the loss's code, and read best on their own.
"""

from __future__ import annotations

import itertools
import math

import torch

from fusedhead.checks import (
    COUNT_FLOOR,
    COUNT_TEXT,
    check_clip_low,
    did_you_mean,
    number_shown,
    one_element_real,
    packed_per_sequence,
    per_token_shape,
    real_in,
    sequences_marked,
    tensor_arg,
)
from fusedhead.errors import type_name
from fusedhead.protocol import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    TIS_CAP_FLOOR,
    TIS_CAP_TEXT,
    HeadCall,
    PolicyLossCall,
)
from fusedhead.request import PolicyRequest
from fusedhead.value_checks import Pending, check_count_value, check_finite_rows, count_checked

#: verl's other names of the KL estimators (``kl_loss_type``); k2+ is k2 itself in verl (the
#: straight-through gradient of k2 is k2's own).
KL_ALIASES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "kl+": "k1+",
    "k2+": "k2",
    "mse+": "k2",
    "low_var_kl+": "k3+",
}
#: Other trainers' names that are no value of an argument here, each told what it is here.
FOREIGN_NAMES = {
    "aggregation": {
        "token-sum": "verl's token-sum is aggregation='token-mean' with loss_normalizer=1.0 "
        "(1 / dp_size under data parallelism, as fusedhead.integrations.verl_config maps it)",
        "grpo": "TRL's loss_type='grpo' is aggregation='seq-mean-token-mean' with "
        "loss_normalizer the micro-batch's rows (TRL's .mean() counts rows without a scored "
        "token too)",
        "seq-mean": "the means over sequences are 'seq-mean-token-sum', 'seq-mean-token-mean' "
        "and 'seq-mean-token-sum-norm' (each sequence's tokens summed, averaged, or summed and "
        "divided by the horizon)",
        "bnpo": "TRL's loss_type='bnpo' is aggregation='token-mean'",
        "dapo": "TRL's loss_type='dapo' is aggregation='token-mean' with loss_normalizer the "
        "global count of scored tokens / num_processes * gradient_accumulation_steps / "
        "steps_per_generation, as TRL divides in training",
        "dr-grpo": "TRL's loss_type='dr_grpo' is aggregation='seq-mean-token-sum-norm' with "
        "horizon=max_completion_length and loss_normalizer the number of sequences",
        **{
            name: f"TRL's loss_type={name!r} is another loss than verl's vanilla PPO, which is "
            "the one computed here; compute it from fused_head's log-probs and entropy"
            for name in ("cispo", "sapo", "luspo", "vespo")
        },
    },
    "kl_estimator": {
        "full": "verl's kl_loss_type='full' needs whole distributions, which a fused head never "
        "holds; the per-token estimators k1, k2 and k3 are computed here",
    },
}
#: Where verl and TRL pass a mask, a fused head reads the labels.
_MASK = "labels set to ignore_index where the mask is 0: labels.masked_fill(mask == 0, -100)"
_VERL_NAMES = {
    "old_log_prob": "old_log_probs",
    "ref_log_prob": "ref_log_probs",
    "clip_ratio_low": "clip_low",
    "clip_ratio_high": "clip_high",
    "clip_ratio_c": "dual_clip",
    "entropy_coeff": "entropy_coef",
    "kl_loss_coef": "kl_coef",
    "kl_loss_type": "kl_estimator",
    "loss_agg_mode": "aggregation",
    "loss_scale_factor": "horizon",
    "rollout_is_threshold": "tis_cap",
}
_TRL_NAMES = {
    "old_per_token_logps": "old_log_probs",
    "ref_per_token_logps": "ref_log_probs",
    "epsilon": "clip_low",
    "epsilon_low": "clip_low",
    "epsilon_high": "clip_high",
    "beta": "kl_coef",
    "max_completion_length": "horizon",
    "vllm_importance_sampling_cap": "tis_cap",
    "vllm_importance_sampling_clip_max": "tis_cap",
}
#: Other trainers' keyword arguments, each told what it is here (``keywords.known_keywords``).
FOREIGN_KEYWORDS = {
    **{k: f"verl's name of {v}" for k, v in _VERL_NAMES.items()},
    **{k: f"TRL's name of {v}" for k, v in _TRL_NAMES.items()},
    "num_items_in_batch": "TRL's token count of a generation batch: pass loss_normalizer="
    "num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation, "
    "as TRL's dapo divides in training (num_items_in_batch / num_processes in evaluation)",
    "delta": "TRL's two-sided clip: dual_clip=delta is the same loss when delta > 1 + clip_high",
    "clip_ratio": "verl's name of clip_low and clip_high together: pass both",
    "response_mask": f"verl's mask: pass {_MASK}",
    "completion_mask": f"TRL's mask: pass {_MASK}",
    "loss_type": "TRL's name of aggregation (bnpo: token-mean; grpo: seq-mean-token-mean with "
    "loss_normalizer the micro-batch's rows; dapo and dr_grpo: docs/policy-loss.md)",
    "log_prob": "the policy's log-probs, which this call computes from hidden and weight",
    "log_probs": "the policy's log-probs, which this call computes from hidden and weight; "
    "the sampling policy's are old_log_probs",
    "importance_sampling_level": "TRL's choice of ratio: 'token' is this loss, 'sequence' "
    "(GSPO) is not computed here",
}
#: Names that ask for sequence-level importance ratios (GSPO), refused by name.
SEQUENCE_LEVEL = ("gspo", "sequence", "seq-ratio", "sequence-level", "geo-mean")
#: The TIS weight as its error names it: NaN only where a rollout log-prob is, as an infinite one
#: is a weight (+inf: 0, which verl's IcePop masks are here; -inf: the cap).
TIS = "the TIS weight exp(old_log_probs - rollout_log_probs)"
#: verl clamps the TIS log-ratio to this before its exp (``rollout_corr_helper.SAFETY_BOUND``).
TIS_LOG_RATIO_BOUND = 20.0


def tis_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``old - rollout`` as the TIS weight's exp takes it: clamped to +-20 as verl's, except
    -inf (a +inf rollout log-prob: a masked token), which stays -inf, a weight of exactly 0."""
    bound = TIS_LOG_RATIO_BOUND
    return torch.where(torch.isneginf(log_ratio), log_ratio, log_ratio.clamp(-bound, bound))


_PER_TOKEN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def policy_call(
    call: HeadCall,
    shape: tuple[int, ...],
    n: int,
    device: torch.device,
    req: PolicyRequest,
    valid: torch.Tensor,
    count: torch.Tensor,
    pending: Pending | None = None,
) -> PolicyLossCall:
    """The loss's own arguments checked and flattened beside the head call."""
    aggregation = _choice("aggregation", req.aggregation, AGGREGATIONS, {})
    sequences_marked(aggregation, shape, req.cu_seqlens)
    estimator = _choice("kl_estimator", req.kl_estimator, KL_ESTIMATORS, KL_ALIASES)
    clip_low = check_clip_low("clip_low", req.clip_low)
    clip_high = real_in("clip_high", req.clip_high, low=0.0, what="a finite float >= 0")
    dual = req.dual_clip
    if dual is not None:
        dual = real_in("dual_clip", dual, low=1.0, what="a finite float > 1 (verl's clip_ratio_c)")
        if dual == 1.0:
            raise ValueError(
                f"dual_clip must be > 1 (verl's clip_ratio_c), got {number_shown(req.dual_clip)!r}"
            )
    entropy_coef = real_in("entropy_coef", req.entropy_coef, low=-math.inf, what="a finite float")
    kl_coef = real_in("kl_coef", req.kl_coef, low=0.0, what="a finite float >= 0")
    old = req.old_log_probs
    old = None if old is None else _per_token("old_log_probs", old, shape, device, "on-policy")
    if req.cu_seqlens is not None:  # the labels' layout first: the advantages' errors assume it
        _packed_layout(shape)
        if isinstance(req.advantages, torch.Tensor):
            packed_per_sequence("advantages", req.advantages, req.cu_seqlens, shape)
    adv = _per_token("advantages", req.advantages, shape, device, per_sequence=True)
    ref = req.ref_log_probs
    ref = None if ref is None else _per_token("ref_log_probs", ref, shape, device, "no KL term")
    if kl_coef and ref is None:
        raise ValueError(
            f"kl_coef={number_shown(req.kl_coef)!r} needs ref_log_probs (the reference policy's log-probs of "
            "the labels); pass them, or kl_coef=0.0"
        )
    rollout, cap = req.rollout_log_probs, req.tis_cap
    if (rollout is None) != (cap is None):
        given, missing = (
            ("rollout_log_probs", "tis_cap") if cap is None else ("tis_cap", "rollout_log_probs")
        )
        raise ValueError(
            f"truncated importance sampling needs both rollout_log_probs and tis_cap: {given} was "
            f"given without {missing}"
        )
    roll = None
    if rollout is not None:
        cap = real_in("tis_cap", cap, low=TIS_CAP_FLOOR, what=TIS_CAP_TEXT)
        roll = _per_token("rollout_log_probs", rollout, shape, device, "no TIS")
        if old is None:
            raise ValueError(
                "truncated importance sampling weighs each token by exp(old_log_probs - "
                "rollout_log_probs): rollout_log_probs was given with old_log_probs=None; pass "
                "the old policy's log-probs"
            )
    tis = None
    if roll is not None and old is not None:
        tis = torch.exp(tis_log_ratio(old - roll)).clamp_(max=cap)
    if pending is not None:  # each finite on the scored rows, in the call's one read
        named = {"old_log_probs": old, "advantages": adv, "ref_log_probs": ref, TIS: tis}
        checked = check_finite_rows(
            {k: v for k, v in named.items() if v is not None}, valid, pending
        )
        old, adv = checked.get("old_log_probs"), checked["advantages"]
        ref, tis = checked.get("ref_log_probs"), checked.get(TIS)
    horizon = req.horizon
    if horizon is not None:
        what = f"a length > 0 (verl's loss_scale_factor, TRL's max_completion_length), {COUNT_TEXT}"
        horizon = real_in("horizon", horizon, low=COUNT_FLOOR, what=what)
        if aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                f"horizon={number_shown(req.horizon)!r} is the length seq-mean-token-sum-norm divides by; "
                f"aggregation={aggregation!r} divides by none: pass horizon=None, or that mode"
            )
    normalizer = _normalizer(req.loss_normalizer, device, pending)
    weights = token_weights(valid, count, shape, aggregation, normalizer, req.cu_seqlens, horizon)
    if req.cu_seqlens is not None and aggregation == "token-mean":
        _sequences(shape, req.cu_seqlens, n, device)  # checked even where it changes nothing
    grad = torch.is_grad_enabled()
    return PolicyLossCall(
        head=call,
        old_log_probs=old,
        advantages=adv,
        token_weight=weights,
        ref_log_probs=ref,
        tis_weight=tis,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual,
        entropy_coef=entropy_coef,
        kl_coef=kl_coef,
        kl_estimator=estimator,
        need_hidden_grad=grad and call.hidden.requires_grad,
        need_weight_grad=grad and call.weight.requires_grad,
    )


def _choice(arg: str, value: object, choices: tuple[str, ...], aliases: dict[str, str]) -> str:
    """``value`` as one of ``choices`` (or an alias of one), with a did-you-mean otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, one of {list(choices)}, got {value!r}")
    if value in choices:
        return value
    if value in aliases:
        return aliases[value]
    if value.lower() in SEQUENCE_LEVEL:
        raise ValueError(
            f"{arg}={value!r} asks for sequence-level importance ratios (GSPO), which "
            "fused_policy_loss does not compute: its ratios are per token (verl's vanilla PPO); "
            f"{arg} must be one of {list(choices)}"
        )
    foreign = FOREIGN_NAMES.get(arg, {}).get(value.lower().replace("_", "-"))
    if foreign:
        raise ValueError(f"{arg}={value!r} is not one of {list(choices)}: {foreign}")
    hint = did_you_mean(value, [*choices, *aliases])
    named = f" (or verl's {list(aliases)})" if aliases else ""
    raise ValueError(f"{arg} must be one of {list(choices)}{named}, got {value!r}{hint}")


def _per_token(
    arg: str,
    value: object,
    shape: tuple[int, ...],
    device: torch.device,
    none: str = "",
    per_sequence: bool = False,
) -> torch.Tensor:
    """A tensor of the labels' shape (or with ``per_sequence``, ``[..., 1]``: one value per
    sequence) as a detached fp32 ``[N]`` copy; ``none`` says what None means where the argument
    may be None. No other broadcast: a ``[1, S]`` or 0-d tensor beside ``[B, S]`` labels is a
    mistake that would silently spread one sequence's values over the batch."""
    if none and not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor or None ({none}), got {type_name(value)}")
    t = tensor_arg(arg, value)
    if t.dtype not in _PER_TOKEN_DTYPES:
        raise TypeError(f"{arg} must be a floating tensor (fp32, fp64, fp16, bf16), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{arg} must be on hidden's device {device}, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{arg} requires grad, but fused_policy_loss differentiates in hidden and weight "
            f"only (no gradient would reach it); pass {arg}.detach()"
        )
    per_token_shape(arg, t, shape, per_sequence)
    return t.detach().expand(shape).reshape(-1).to(torch.float32).contiguous()


def _normalizer(
    value: object, device: torch.device, pending: Pending | None = None
) -> torch.Tensor | None:
    """``loss_normalizer`` as an fp32 0-d tensor on the device. A tensor's value is checked (a
    count > 0, finite) by ``pending``'s one read, with the labels' range, or in a compiled graph
    by its own op, as the labels are; ``pending=None`` (the call's ``check_labels=False``): not
    read."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = tensor_arg("loss_normalizer", value)
        one_element_real("loss_normalizer", t)
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "loss_normalizer requires grad, but fused_policy_loss differentiates in hidden "
                "and weight only (no gradient would reach it); pass loss_normalizer.detach()"
            )
        if t.device != device and t.device.type != "cpu":
            where = f"hidden's device {device}" + ("" if device.type == "cpu" else " or the CPU")
            raise ValueError(f"loss_normalizer must be on {where}, got {t.device}")
        out = t.detach().reshape(()).to(device=device, dtype=torch.float32)
        if pending is None or out.device.type == "meta":
            return out
        if torch.compiler.is_compiling():  # the check as a graph op, as the labels' is
            checked: torch.Tensor = count_checked(out, "loss_normalizer")
            return checked
        check_count_value(out, "loss_normalizer", pending)
        return out
    return torch.tensor(
        real_in(
            "loss_normalizer",
            value,
            low=COUNT_FLOOR,
            what=f"a count > 0 (tokens or sequences), {COUNT_TEXT}",
        ),
        dtype=torch.float32,
        device=device,
    )


def _packed_layout(shape: tuple[int, ...]) -> None:
    """``cu_seqlens`` describes one packed row: labels ``[T]`` or ``[1, T]`` (their shape only)."""
    if len(shape) > 2 or (len(shape) == 2 and shape[0] != 1):
        raise ValueError(
            f"cu_seqlens describes a packed batch: labels must be [T] or [1, T], got {shape}; "
            "for a padded [B, S] batch (one sequence a row) pass cu_seqlens=None"
        )


def _sequences(
    shape: tuple[int, ...], cu_seqlens: object, n: int, device: torch.device
) -> tuple[torch.Tensor, int, int]:
    """Each token's sequence index, the number of sequences and the horizon (longest length)."""
    if cu_seqlens is None:
        width = shape[-1] if shape else 1
        count = n // width if width else 0
        seq = torch.arange(n, device=device) // max(width, 1)
        return seq, count, width
    cu = tensor_arg("cu_seqlens", cu_seqlens)
    if cu.device not in (device, torch.device("cpu")) or cu.device.type == "meta":
        also = "" if device.type == "cpu" else " or the CPU"
        raise ValueError(f"cu_seqlens must be on hidden's device {device}{also}, got {cu.device}")
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor of sequence starts [0, ..., T] "
            f"(at least 2 entries), got {cu.dtype} of shape {tuple(cu.shape)}"
        )
    _packed_layout(shape)
    bounds = cu.tolist()  # a few ints: the check reads them once
    if bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the {n} tokens, got "
            f"{bounds if len(bounds) <= 12 else [*bounds[:6], '...', *bounds[-3:]]}"
        )
    ends = cu.to(device=device, dtype=torch.int64)[1:]
    seq = torch.bucketize(torch.arange(n, device=device), ends, right=True)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    return seq, len(bounds) - 1, longest


def token_weights(
    valid: torch.Tensor,
    tokens: torch.Tensor,
    shape: tuple[int, ...],
    aggregation: str,
    normalizer: torch.Tensor | None,
    cu_seqlens: object,
    horizon: float | None = None,
) -> torch.Tensor:
    """The aggregation (verl's ``loss_agg_mode``) as one fp32 weight per token, 0 where ignored.

    ``normalizer`` replaces the count the mean divides by: valid tokens for ``token-mean``,
    sequences with a valid token for the ``seq-mean-*`` modes. ``horizon`` replaces the length
    ``seq-mean-token-sum-norm`` divides by (the batch's width, or a packed batch's longest
    sequence), so that micro-batches of any width add up. ``tokens``: ``valid.sum()``, the
    call's one count of scored tokens (read with its value checks).
    """
    if aggregation == "token-mean":
        denom = tokens.to(torch.float32) if normalizer is None else normalizer
        return _scored(valid, denom.reciprocal())
    n = valid.shape[0]
    device = valid.device
    ones = valid.to(torch.float32)
    seq, count, longest = _sequences(shape, cu_seqlens, n, device)
    length = float(longest if horizon is None else horizon)
    per_seq = torch.zeros(count, dtype=torch.float32, device=device).index_add_(0, seq, ones)
    seqs = (per_seq > 0).sum().to(torch.float32) if normalizer is None else normalizer
    if aggregation == "seq-mean-token-sum":
        return _scored(valid, 1.0 / seqs)
    if aggregation == "seq-mean-token-mean":
        return _scored(valid, 1.0 / (per_seq[seq] * seqs))
    return _scored(valid, 1.0 / (seqs * length))  # seq-mean-token-sum-norm


def _scored(valid: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` at scored tokens, 0 elsewhere. A weight is never 0 at a scored token (a weight
    of 0 marks an ignored one, to the metrics and the backends): one that underflows fp32 (a
    normaliser times a horizon near 2**126) is held at the smallest normal number."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where(valid, torch.where(weight == 0, tiny, weight), 0.0)
