"""TRL: GRPO's loss from ``fused_policy_loss`` (``FusedHeadGRPOConfig(fused_policy_loss=True)``).

The trainer's ``_compute_loss`` is :func:`grpo_fused_policy_loss`: TRL's own per-token forward of
the policy runs, and the fused LM head installed by :func:`fusedhead.integrations.trl.add_fused_lm_head`
finds the pending loss (:func:`pending_policy_loss`) and computes it from the hidden states in three
GEMMs per chunk. :func:`check_policy_loss_args` refuses, when the config is built, what it does not
compute. TRL is imported only when a trainer runs.
"""

from __future__ import annotations

import contextvars
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusedhead.api import FusedHead
from fusedhead.checks import check_clip_low, real_in
from fusedhead.integrations.backend_spec import (
    HeadLike,
    lacks_policy_loss,
)
from fusedhead.integrations.lm_head import (
    lm_head_policy_loss,
)
from fusedhead.integrations.trl_config import (
    BACKEND_FIELD,
    check_args_device,
    config_argument,
    resolve_named,
    trainer_device,
    trl_utils,
)
from fusedhead.policy_output import PolicyLossOutput

__all__ = [
    "POLICY_LOSS_TYPES",
    "FusedPolicyLossFields",
    "FusedPolicyLossMixin",
    "PendingPolicyLoss",
    "check_policy_loss_args",
    "grpo_fused_policy_loss",
    "pending_policy_loss",
    "policy_loss_forward",
]

#: TRL ``loss_type`` values that ``fused_policy_loss`` computes, with fusedhead's aggregation:
#: ``grpo`` a mean of sequence means over the batch's rows, ``bnpo`` a token mean, ``dr_grpo`` a
#: token sum over rows x ``max_completion_length``, ``dapo`` a token sum over the global count.
POLICY_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "token-mean",
    "dapo": "token-mean",
}
#: The multimodal inputs TRL's ``_compute_loss`` hands to its per-token forward.
_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass
class PendingPolicyLoss:
    """What the trainer asks of the policy's next fused forward: the loss's keywords (per-token
    tensors of the completion, ``[B, keep]``), the completion length and the loss mask."""

    spec: dict[str, Any]
    keep: int
    loss_mask: torch.Tensor
    result: PolicyLossOutput | None = None


#: Set by :func:`grpo_fused_policy_loss` around TRL's per-token forward of the policy.
_PENDING_POLICY_LOSS: contextvars.ContextVar[PendingPolicyLoss | None] = contextvars.ContextVar(
    "fusedhead_trl_policy_loss", default=None
)


def pending_policy_loss() -> PendingPolicyLoss | None:
    """The loss :func:`grpo_fused_policy_loss` asks of the policy's forward now, if any: the fused
    LM head then computes it (:func:`policy_loss_forward`) instead of the log-probs alone."""
    return _PENDING_POLICY_LOSS.get()


def policy_loss_forward(
    pending: PendingPolicyLoss,
    output_cls: Any,
    lm_head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    head: FusedHead,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    compute_dtype: torch.dtype | None,
    aux_loss: torch.Tensor | None,
) -> Any:
    """The fused policy loss of the completion from the shifted hidden states, in TRL's output.

    The loss goes to ``pending.result``; TRL gets ``[B, T-1]`` detached log-probs and entropy
    (the completion at the end, as its forward returns them) for its own bookkeeping.
    """
    if pending.result is not None:
        raise RuntimeError(
            "fused_policy_loss: the policy's forward ran twice for one loss (TRL split the batch "
            "into chunks); the fused loss needs the whole micro-batch in one call"
        )
    keep = pending.keep
    h, y = hidden[:, -keep:], targets[:, -keep:]
    y = y.masked_fill(~pending.loss_mask.to(device=y.device, dtype=torch.bool), -100)
    spec = dict(pending.spec)
    common: dict[str, Any] = dict(
        head=head,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        compute_dtype=compute_dtype,
    )
    # old_log_probs None (TRL did not compute them): TRL's ratio exp(lp - lp.detach()), which the
    # fused loss takes as on-policy, with no GEMM for them
    out = lm_head_policy_loss(lm_head, h, y, **common, **spec)
    pending.result = out

    def full(x: torch.Tensor) -> torch.Tensor:
        z = x.new_zeros(targets.shape)
        z[:, -keep:] = x
        return z

    return output_cls(
        loss=out.loss,
        log_probs=full(out.log_probs),
        entropy=full(out.entropy),
        label_mask=targets != -100,
        aux_loss=aux_loss,
    )


def _is_clip_max(args: Any) -> float | None:
    cap = getattr(args, "vllm_importance_sampling_clip_max", None)
    if cap is None:
        cap = getattr(args, "vllm_importance_sampling_cap", None)
    return None if cap is None else float(cap)


def check_policy_loss_args(
    args: Any, head: FusedHead | None = None, *, setting: str = BACKEND_FIELD
) -> None:
    """Refuse, by name, a GRPO config whose loss ``fused_policy_loss`` does not compute.

    Called when a ``FusedHeadGRPOConfig`` with ``fused_policy_loss=True`` (and its trainer) is
    built. Each refusal is a ``ValueError`` naming the setting, its value and what maps; a
    backend that does not declare ``policy_loss`` on the trainer's device is a
    ``CapabilityError``.
    """
    enabled = getattr(args, "fused_policy_loss", False)
    if not isinstance(enabled, bool):  # "no" would be truthy: a switch is True or False
        raise TypeError(
            f"fused_policy_loss must be True or False, got {enabled!r} ({type(enabled).__name__})"
        )
    if not enabled:
        return
    off = "or set fused_policy_loss=False for TRL's own loss"
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(
            f"fused_policy_loss=True with loss_type={loss_type!r}: fused_policy_loss computes TRL's "
            f"clipped-surrogate loss types {list(POLICY_LOSS_TYPES)}; {loss_type!r} is another "
            f"loss: pick one of those, {off}"
        )
    level = getattr(args, "importance_sampling_level", "token")
    if level != "token":
        raise ValueError(
            f"fused_policy_loss=True with importance_sampling_level={level!r} (GSPO): "
            f"fused_policy_loss's ratios are per token; use 'token', {off}"
        )
    # Each value fused_policy_loss takes, checked by the core's own checks under TRL's name:
    # what it would refuse at the first step (by its own argument's name) is refused here.
    high = "epsilon" if args.epsilon_high is None else "epsilon_high"
    numbers: tuple[tuple[str, Callable[..., float], dict[str, Any]], ...] = (
        ("epsilon", check_clip_low, {}),
        (high, real_in, dict(low=0.0, what="a finite float >= 0")),
        ("beta", real_in, dict(low=0.0, what="a finite float >= 0 (the KL coefficient)")),
        ("entropy_coef", real_in, dict(low=-math.inf, what="a finite float")),
    )
    for name, check, bounds in numbers:
        try:
            check(name, getattr(args, name, 0.0), **bounds)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"fused_policy_loss=True: {exc}; change it, {off}") from None
    eps_high = getattr(args, high)
    delta = getattr(args, "delta", None)
    if (
        delta is not None
        and delta != math.inf
        and not (math.isfinite(delta) and delta > 1 + eps_high)
    ):
        raise ValueError(
            f"fused_policy_loss=True with delta={delta!r}: TRL's two-sided clip is verl's dual "
            f"clip only for delta > 1 + epsilon_high = {1 + eps_high}; raise delta, {off}"
        )
    refused = {
        "use_bias_correction_kl": (
            getattr(args, "use_bias_correction_kl", False) and getattr(args, "beta", 0.0) != 0.0,
            f"with beta={getattr(args, 'beta', None)!r} TRL multiplies the KL by the ratio "
            "(differentiable, so the gradient changes even on-policy), which is not a term of "
            "fused_policy_loss",
            "set use_bias_correction_kl=False (TRL's default is True; False is the plain KL term)",
        ),
        "top_entropy_quantile": (
            getattr(args, "top_entropy_quantile", 1.0) < 1.0,
            "a mask from the entropies needs them before the loss, which computes them",
            "",
        ),
        "off_policy_mask_threshold": (
            getattr(args, "off_policy_mask_threshold", None) is not None,
            "a sequence mask from the current log-probs needs them before the loss",
            "",
        ),
        "use_adaptive_entropy": (
            getattr(args, "use_adaptive_entropy", False),
            "the adaptive entropy coefficient is not mapped",
            "",
        ),
    }
    for name, (bad, why, fix) in refused.items():
        if bad:
            fix = fix or f"leave {name} at its default"
            raise ValueError(
                f"fused_policy_loss=True with {name}={getattr(args, name)!r}: {why}; {fix}, {off}"
            )
    if getattr(args, "entropy_coef", 0.0) != 0.0 and loss_type != "bnpo":
        raise ValueError(
            f"fused_policy_loss=True with entropy_coef={args.entropy_coef!r} and loss_type="
            f"{loss_type!r}: TRL averages the entropy bonus over tokens and the {loss_type!r} "
            "policy term its own way, where fused_policy_loss aggregates both one way; use "
            f"loss_type='bnpo' (a token mean for both) or entropy_coef=0.0, {off}"
        )
    if getattr(args, "use_vllm", False) and getattr(
        args, "vllm_importance_sampling_correction", False
    ):
        mode = getattr(args, "vllm_importance_sampling_mode", None)
        low = getattr(args, "vllm_importance_sampling_clip_min", None)
        if mode != "token_truncate":
            raise ValueError(
                f"fused_policy_loss=True with vllm_importance_sampling_mode={mode!r}: "
                "fused_policy_loss's truncated importance sampling is per token, "
                "min(ratio, cap): use 'token_truncate' (or vllm_importance_sampling_correction="
                f"False), {off}"
            )
        if low is not None and low > 0:
            raise ValueError(
                f"fused_policy_loss=True with vllm_importance_sampling_clip_min={low!r}: "
                f"fused_policy_loss truncates the ratio from above only; set it to None, {off}"
            )
        if _is_clip_max(args) is None:
            raise ValueError(
                "fused_policy_loss=True with vllm_importance_sampling_clip_max=None: "
                f"fused_policy_loss's truncation needs a cap (TRL's default 3.0), {off}"
            )
    fused = check_args_device(args) if head is None else head
    device = trainer_device(args)[0]
    if not fused.capabilities(device).policy_loss:
        raise lacks_policy_loss(
            fused,
            f"fused_policy_loss=True needs a backend that declares policy_loss on "
            f"{device.type}; {fused.name!r} does not",
            f"name one in {setting} (e.g. 'torch', or 'triton' on a GPU), or set "
            "fused_policy_loss=False",
        )


def grpo_fused_policy_loss(trainer: Any, model: nn.Module, inputs: Mapping[str, Any]) -> Any:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` with the loss from ``fused_policy_loss``.

    The policy's forward runs through TRL's own ``_get_per_token_logps_and_entropies`` (its
    inputs, multimodal ones included); the fused forward installed by :func:`add_fused_lm_head`
    sees the pending loss and computes it from the hidden states in three GEMMs per chunk. The
    loss, its scaling for gradient accumulation and every metric TRL logs are TRL's.
    """
    from accelerate.utils import gather

    utils = trl_utils()
    args = trainer.args
    loss_type = trainer.loss_type
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mode = "train" if trainer.model.training else "eval"
    accum = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    rows = completion_ids.size(0)
    normalizer: float | torch.Tensor | None = None
    divide = accum
    if loss_type == "grpo":
        normalizer = float(rows)  # TRL's .mean() counts rows without a scored token
    elif loss_type == "dr_grpo":
        normalizer = float(rows * trainer.max_completion_length)
    elif loss_type == "dapo":
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accum / args.steps_per_generation
        divide = 1.0
    coef = trainer.entropy_coef if trainer._entropy_bonus_enabled else 0.0
    old = inputs.get("old_per_token_logps")
    spec: dict[str, Any] = dict(
        old_log_probs=old,
        advantages=advantages,
        clip_low=trainer.epsilon_low,
        clip_high=trainer.epsilon_high,
        dual_clip=None if args.delta == math.inf else args.delta,  # TRL's clamp at inf: none
        entropy_coef=coef,
        ref_log_probs=inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None,
        kl_coef=trainer.beta,
        kl_estimator="k3-unclamped",  # TRL's exp(d) - d - 1, without verl's clamps
        aggregation=POLICY_LOSS_TYPES[loss_type],
        loss_normalizer=normalizer,
    )
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        sampling = inputs["sampling_per_token_logps"]
        if old is None:  # TRL computes them whenever it corrects vLLM's sampling
            raise RuntimeError("vLLM importance sampling without old_per_token_logps in inputs")
        # TRL: a token vLLM could not score (NaN) gets ratio 1
        spec["rollout_log_probs"] = torch.where(sampling.isnan(), old, sampling)
        spec["tis_cap"] = _is_clip_max(args)
    pending = PendingPolicyLoss(spec, keep, mask)
    token = _PENDING_POLICY_LOSS.set(pending)
    try:
        _, _, aux_loss = trainer._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            keep,
            compute_entropy=True,
            compute_aux_loss=trainer.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MODEL_INPUTS},
        )
    finally:
        _PENDING_POLICY_LOSS.reset(token)
    out = pending.result
    if out is None:
        raise RuntimeError(
            "fused_policy_loss: the policy's forward is not fusedhead's (add_fused_lm_head); "
            "build the trainer as FusedHeadGRPOTrainer"
        )
    loss = out.loss / divide
    metrics = trainer._metrics[mode]
    if trainer._entropy_bonus_enabled:
        policy_loss = (out.loss + coef * out.entropy_loss).detach()
        metrics["policy_loss"].append(gather(policy_loss).nanmean().item())
        if mode == "train" and trainer.accelerator.sync_gradients:
            metrics["entropy_coef"].append(trainer.entropy_coef)
    if trainer.aux_loss_enabled:
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accum
        metrics["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_grpo_metrics(trainer, metrics, out, old, mask, advantages, inputs, utils)
    return loss


def _log_grpo_metrics(
    trainer: Any,
    metrics: Any,
    out: PolicyLossOutput,
    old: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    inputs: Mapping[str, Any],
    utils: types.ModuleType,
) -> None:
    """TRL's logged KL, entropy and clip ratios, computed as TRL does from the fused log-probs."""
    lp = out.log_probs
    reduce = trainer.accelerator.reduce

    def global_masked_mean(x: torch.Tensor) -> float:
        totals = reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return float((totals[0] / totals[1].clamp(min=1.0)).item())

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum(-1) / mask.sum(-1)

    if trainer.beta != 0.0:
        d = inputs["ref_per_token_logps"] - lp
        metrics["kl"].append(global_masked_mean(torch.exp(d) - d - 1))
    metrics["entropy"].append(global_masked_mean(out.entropy))
    ratio = torch.exp(lp - (lp if old is None else old))
    if trainer.args.delta is not None:
        ratio = torch.clamp(ratio, max=trainer.args.delta)
    low = (ratio < 1 - trainer.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + trainer.epsilon_high) & (advantages > 0)
    metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
    metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
    metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
    gathered_low = trainer.accelerator.gather(masked_seq_mean(low.float()))
    metrics["clip_ratio/low_min"].append(utils.nanmin(gathered_low).item())
    gathered_high = trainer.accelerator.gather(masked_seq_mean(high.float()))
    metrics["clip_ratio/high_max"].append(utils.nanmax(gathered_high).item())


def _is_head_mixin(cls: type) -> bool:
    """``cls`` is ``fusedhead.integrations.trl.FusedHeadTrainerMixin``."""
    return (cls.__module__, cls.__qualname__) == (
        "fusedhead.integrations.trl",
        "FusedHeadTrainerMixin",
    )


class FusedPolicyLossMixin:
    """Put before ``FusedHeadTrainerMixin`` on a GRPO trainer, ``class MyGRPOTrainer(
    FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer)``: with
    ``args.fused_policy_loss`` the loss is :func:`grpo_fused_policy_loss` (checked by
    :func:`check_policy_loss_args` before TRL's init), else TRL's own ``_compute_loss``. Without
    ``FusedHeadTrainerMixin`` after it in the bases the trainer is refused when built (the loss
    runs inside the LM head that mixin installs)."""

    args: Any

    def __init__(self, *args: Any, fused_head: HeadLike = None, **kwargs: Any) -> None:
        cls = type(self)
        after = cls.__mro__[cls.__mro__.index(FusedPolicyLossMixin) :]
        # by name: fusedhead.integrations.trl imports this module, never the other way round
        if not any(_is_head_mixin(c) for c in after):
            raise TypeError(
                f"{cls.__name__} has FusedPolicyLossMixin without FusedHeadTrainerMixin after it in "
                "its bases: the fused loss runs inside fusedhead's LM head, which "
                "FusedHeadTrainerMixin installs. Use FusedHeadGRPOTrainer, or the bases "
                f"class {cls.__name__}(FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer)"
            )
        config = config_argument(self, FusedPolicyLossMixin, args, kwargs)
        if getattr(config, "fused_policy_loss", False) is not False:  # a non-bool is refused
            head, setting, _ = resolve_named(config, fused_head)
            check_policy_loss_args(config, head, setting=setting)
        super().__init__(*args, fused_head=fused_head, **kwargs)  # type: ignore[call-arg]

    def _compute_loss(self, model: nn.Module, inputs: Mapping[str, Any]) -> Any:
        if not getattr(self.args, "fused_policy_loss", False):
            return super()._compute_loss(model, inputs)  # type: ignore[misc]
        return grpo_fused_policy_loss(self, model, inputs)


@dataclass
class FusedPolicyLossFields:
    """The config field FusedHeadGRPOConfig adds: the loss from ``fused_policy_loss``."""

    fused_policy_loss: bool = field(
        default=False,
        metadata={
            "help": "Compute the GRPO loss with fusedhead.fused_policy_loss (loss types grpo, "
            "bnpo, dr_grpo, dapo): its gradients in the forward, three GEMMs per chunk."
        },
    )
