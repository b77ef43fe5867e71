"""The RL policy loss inside the head: ``FusedHead.policy_loss`` and ``fused_policy_loss``'s body.

The call is checked here once (the head's own checks, then the loss's arguments), the
aggregation becomes one weight per token, the backend computes each row's statistics and the
loss's gradients in its forward (three GEMMs per token chunk), and the loss is formed here from
the statistics it returns, with the gradients attached for ``loss.backward()``.
docs/policy-loss.md states the semantics (verl's ``core_algos``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from fusedhead.checks import (
    COUNT_FLOOR,
    COUNT_TEXT,
    check_clip_low,
    did_you_mean,
    one_element_real,
    packed_per_sequence,
    per_token_shape,
    real_in,
    tensor_arg,
)
from fusedhead.contract import gate_head, gate_policy_loss
from fusedhead.errors import BackendError, BackendUnavailableError, note_backend
from fusedhead.policy_terms import LOG_RATIO_BOUND, kl_penalty, on_policy_log_ratio, token_grads
from fusedhead.protocol import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    Capabilities,
    HeadCall,
    PolicyLossCall,
    PolicyLossResult,
)
from fusedhead.request import HeadRequest, PolicyRequest
from fusedhead.scored_rows import ScoredRows, nothing_scored
from fusedhead.validation import validate
from fusedhead.value_checks import Pending, check_count_value, count_checked

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
        "grpo": "TRL's loss_type='grpo' is aggregation='seq-mean-token-mean'",
        "bnpo": "TRL's loss_type='bnpo' is aggregation='token-mean'",
        "dapo": "TRL's loss_type='dapo' is aggregation='token-mean' with loss_normalizer the "
        "global count of scored tokens / num_processes",
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
    "loss_type": "TRL's name of aggregation (bnpo: token-mean, grpo: seq-mean-token-mean, "
    "dapo and dr_grpo: docs/policy-loss.md)",
    "log_prob": "the policy's log-probs, which this call computes from hidden and weight",
    "log_probs": "the policy's log-probs, which this call computes from hidden and weight; "
    "the sampling policy's are old_log_probs",
    "importance_sampling_level": "TRL's choice of ratio: 'token' is this loss, 'sequence' "
    "(GSPO) is not computed here",
}
#: Names that ask for sequence-level importance ratios (GSPO), refused by name.
SEQUENCE_LEVEL = ("gspo", "sequence", "seq-ratio", "sequence-level", "geo-mean")
_PER_TOKEN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _Head(Protocol):
    """What the policy loss needs of a ``FusedHead`` (typed here, so this module imports no api)."""

    backend: Any

    def ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities: ...
    def capabilities(self, device: torch.device) -> Capabilities: ...
    def identity(self) -> dict[str, str | None]: ...
    def broke(self, reason: str) -> NoReturn: ...


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


class _AttachedGradients(torch.autograd.Function):
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


def _attach_eager(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    loss: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """``loss`` with the stored gradients attached for its backward."""
    out: torch.Tensor = _AttachedGradients.apply(  # type: ignore[no-untyped-call]
        hidden, weight, loss, grad_hidden, grad_weight
    )
    return out


#: ``_attach_eager`` never traced: Dynamo would trace the backward too, and break its graph at
#: the scale's host read with a warning on every compile.
_attach: Callable[..., torch.Tensor] = torch.compiler.disable(_attach_eager)  # type: ignore[no-untyped-call]


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
        raise TypeError(
            f"{arg} must be a torch.Tensor or None ({none}), got {type(value).__name__}"
        )
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
    pcall = _policy_call(call, shape, n, device, req, valid, count, pending)
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
    return _output(pcall, result, shape)


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
    _check_result(head, sub, result, scored, call.head.hidden.device)
    return result if sub is call or rows is None else rows.spread(result, call)


#: ``_backend_result`` run as in eager mode: under ``torch.compile`` a graph break, and never a
#: frame Dynamo compiles (it compiled the triton backend's kernel launches and failed there).
#: About 1 us a call in eager mode.
_untraced: Callable[
    [_Head, PolicyLossCall, str | None, torch.Tensor | None, ScoredRows | None], PolicyLossResult
]
_untraced = torch.compiler.disable(_backend_result)  # type: ignore[no-untyped-call]  # untyped


def _policy_call(
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
    estimator = _choice("kl_estimator", req.kl_estimator, KL_ESTIMATORS, KL_ALIASES)
    clip_low = check_clip_low("clip_low", req.clip_low)
    clip_high = real_in("clip_high", req.clip_high, low=0.0, what="a finite float >= 0")
    dual = req.dual_clip
    if dual is not None:
        dual = real_in("dual_clip", dual, low=1.0, what="a finite float > 1 (verl's clip_ratio_c)")
        if dual == 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c), got {req.dual_clip!r}")
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
            f"kl_coef={req.kl_coef!r} needs ref_log_probs (the reference policy's log-probs of "
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
    tis = None
    if rollout is not None:
        cap = real_in("tis_cap", cap, low=1e-30, what="a finite float > 0")
        roll = _per_token("rollout_log_probs", rollout, shape, device, "no TIS")
        if old is None:
            raise ValueError(
                "truncated importance sampling weighs each token by exp(old_log_probs - "
                "rollout_log_probs): rollout_log_probs was given with old_log_probs=None; pass "
                "the old policy's log-probs"
            )
        tis = torch.exp(old - roll).clamp_(max=cap)
    horizon = req.horizon
    if horizon is not None:
        what = f"a length > 0 (verl's loss_scale_factor, TRL's max_completion_length), {COUNT_TEXT}"
        horizon = real_in("horizon", horizon, low=COUNT_FLOOR, what=what)
        if aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                f"horizon={req.horizon!r} is the length seq-mean-token-sum-norm divides by; "
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


def _check_result(
    head: _Head, call: PolicyLossCall, result: object, n: int, device: torch.device
) -> None:
    """The backend's result against the contract; a breach is a ``BackendContractError``."""
    if not isinstance(result, PolicyLossResult):
        head.broke(
            f"policy_loss() must return a fusedhead.protocol.PolicyLossResult, got "
            f"{type(result).__name__}"
        )
    for what, stat in (("log_probs", result.log_probs), ("entropy", result.entropy)):
        t: Any = stat
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (n,):
            head.broke(f"policy_loss's {what} must be float32 [{n}], got {_describe(t)}")
        if t.device != device:
            head.broke(f"policy_loss's {what} must be on {device}, got {t.device}")
    h, w = call.head.hidden, call.head.weight
    for what, need, t, like in (
        ("grad_hidden", call.need_hidden_grad, result.grad_hidden, h),
        ("grad_weight", call.need_weight_grad, result.grad_weight, w),
    ):
        if not need:
            if t is not None:
                head.broke(f"policy_loss's {what} was not asked for and must be None")
            continue
        widened = like.dtype == torch.float16 and getattr(t, "dtype", None) == torch.float32
        if (
            not isinstance(t, torch.Tensor)
            or t.shape != like.shape
            or (t.dtype != like.dtype and not widened)
            or t.device != like.device
        ):
            also = " (or float32)" if like.dtype == torch.float16 else ""
            head.broke(
                f"policy_loss's {what} must be {like.dtype}{also} {tuple(like.shape)} on "
                f"{like.device}, got {_describe(t)}"
            )
    _check_fresh(head, call, result)


def _check_fresh(head: _Head, call: PolicyLossCall, result: PolicyLossResult) -> None:
    """The gradients are fresh memory of their own: the backward scales them in place and
    autograd may keep them as ``.grad``, so one that overlaps itself (an ``expand``) or shares
    memory with an input or the other outputs would fail there or corrupt what it shares."""
    named = [("grad_hidden", result.grad_hidden), ("grad_weight", result.grad_weight)]
    others = [
        ("hidden", call.head.hidden),
        ("weight", call.head.weight),
        ("log_probs", result.log_probs),
        ("entropy", result.entropy),
        *named,
    ]
    for what, t in named:
        if t is None:
            continue
        if _overlaps_itself(t):
            head.broke(
                f"policy_loss's {what} must be a fresh tensor, got one whose elements share "
                f"memory (strides {tuple(t.stride())} for shape {tuple(t.shape)}, e.g. an "
                "expand): the backward scales it in place"
            )
        mine = t.untyped_storage().data_ptr()
        if mine == 0:  # no memory to share (empty, or the meta device)
            continue
        for other, u in others:
            if other != what and u is not None and u.untyped_storage().data_ptr() == mine:
                head.broke(
                    f"policy_loss's {what} must be a fresh tensor, got one that shares memory "
                    f"with {other}: the backward scales it in place and autograd may keep it"
                )


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements are one memory location (a stride of 0 where the size
    is more than 1, or strides that interleave)."""
    dims = sorted((st, size) for st, size in zip(t.stride(), t.shape, strict=True) if size > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * size
    return False


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return f"{type(t).__name__}"


def _output(
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
