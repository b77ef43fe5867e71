"""TRL: its fused-LM-head contract served by a fusedhead backend chosen by name from the config.

TRL's trainers (GRPO, RLOO, DPO, KTO, SFT) call ``trl.trainer.utils.add_fused_lm_head(model, ...)``
in their ``__init__``; it replaces ``model.forward`` so that ``model(..., labels=labels,
fused_lm_head=True)`` returns a ``FusedCausalLMOutput`` (per-token log-probs, entropy, loss)
computed by TRL's own chunked kernel. This module keeps that contract and swaps the kernel:

- :func:`add_fused_lm_head`: the same signature plus ``head=`` (a backend name or config);
- :class:`FusedHeadTrainerMixin`: after the TRL trainer's ``__init__``, every model that TRL gave
  its fused head (policy and reference) gets fusedhead's instead, with the same temperature and
  fp32 setting, the backend read from ``args.fused_head_backend`` (and
  ``args.fused_head_options``) or the ``fused_head=`` keyword;
- ``FusedHead{GRPO,RLOO,SFT,DPO,KTO}Trainer`` / ``...Config``: the mixin and the two config
  fields on TRL's own classes.

Nothing in TRL is patched: the model's ``forward`` is layered exactly as TRL itself layers it
(calls without ``fused_lm_head=True`` go through TRL's forward unchanged, so generation is
untouched). TRL is imported only when one of these names is used. Tested with TRL 1.16.0.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusedhead.api import FusedHead
from fusedhead.checks import check_clip_low, real_in
from fusedhead.errors import CapabilityError, OptionsError
from fusedhead.integrations.lm_head import (
    HeadLike,
    check_head_runs_on,
    is_fusedhead_spec,
    lm_head_logprobs,
    lm_head_policy_loss,
    model_logit_transform,
    parse_backend_spec,
    resolve_lm_head,
)
from fusedhead.options import load_json
from fusedhead.policy import PolicyLossOutput

__all__ = [
    "POLICY_LOSS_TYPES",
    "SUPPORTED_OUTPUTS",
    "TESTED_TRL",
    "FusedHeadTrainerMixin",
    "FusedPolicyLossMixin",
    "add_fused_lm_head",
    "check_args_device",
    "check_policy_loss_args",
    "fused_head_from_args",
    "fused_head_of",
    "grpo_fused_policy_loss",
    "replace_trl_fused_heads",
    "resolve_named",
    "trainer_device",
]

#: TRL versions this module was tested against.
TESTED_TRL = ">=1.16.0,<1.17"
#: ``FusedCausalLMOutput`` fields fusedhead computes: ``is_top1`` from the backend's argmax,
#: ``log_sum_sq_probs`` from its sum of squared probabilities, ``mean_logits`` (a DPO / KTO
#: metric) from the mean weight row, as the mean logit is linear in it (not under a softcap).
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: Marks a forward installed here (the installing head is the value).
_MARK = "__fusedhead_head__"


def _trl_utils() -> types.ModuleType:
    try:
        import trl.trainer.utils as utils
    except ImportError as exc:
        raise ImportError(
            f"fusedhead.integrations.trl needs TRL ({TESTED_TRL} tested): pip install 'trl{TESTED_TRL}' "
            f"({exc})"
        ) from exc
    module: types.ModuleType = utils  # Any where TRL is not installed (mypy without the trainers)
    return module


def _check_outputs(outputs: object) -> tuple[str, ...]:
    if isinstance(outputs, str) or not isinstance(outputs, (tuple, list)):
        raise TypeError(
            f"outputs must be a tuple of field names, got {type(outputs).__name__} {outputs!r}"
        )
    unknown = [o for o in outputs if o not in _TRL_OUTPUTS]
    if unknown:
        raise ValueError(f"outputs {unknown} are not fields TRL knows; known: {list(_TRL_OUTPUTS)}")
    unsupported = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
    if unsupported:
        raise ValueError(
            f"outputs {unsupported} (asked for by the trainer) are not computed by fusedhead, which "
            f"returns {list(SUPPORTED_OUTPUTS)}: keep TRL's own kernel for this trainer"
        )
    return tuple(outputs)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _logit_scale(text_config: Any) -> float:
    """The multiplier a model applies to its logits before any softcap (1.0 for most models)."""
    return model_logit_transform(text_config)[0]


def _backbone(model: nn.Module, text_config: Any) -> nn.Module:
    """The decoder body: ``model.base_model`` (vision-language models on transformers < 5: ``.model``)."""
    import transformers
    from packaging.version import Version

    if text_config is not getattr(model, "config", None) and Version(
        transformers.__version__
    ) < Version("5.0.0"):
        body = getattr(model, "model", None)
    else:
        body = getattr(model, "base_model", None)
    if not isinstance(body, nn.Module) or body is model:
        raise ValueError(
            f"cannot find the backbone of {type(model).__name__} (base_model); pass a causal LM"
        )
    return body


def add_fused_lm_head(
    model: nn.Module,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    head: HeadLike = None,
) -> None:
    """TRL's ``add_fused_lm_head`` contract on a fusedhead backend (``head``: a name or config).

    Afterwards ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` (``log_probs``, ``entropy`` when in ``outputs``, ``loss``,
    ``label_mask``, ``aux_loss`` for MoE) without forming ``[B, T, V]`` logits; ``shift_labels``
    are scored without shifting. Any other call goes to the forward the model had, unchanged.
    The LM head's weight is read inside the head module's call (FSDP2 / ZeRO-3 gather it there).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            f"temperature must be a float, got {type(temperature).__name__} {temperature!r}"
        )
    if not isinstance(cast_lm_head_to_fp32, bool):
        raise TypeError(
            f"cast_lm_head_to_fp32 must be a bool, got {type(cast_lm_head_to_fp32).__name__}"
        )
    wanted = _check_outputs(outputs)
    fused = resolve_lm_head(head)
    text_config = _text_config(model)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if "mean_logits" in wanted and softcap is not None:
        raise ValueError(
            f"outputs ['mean_logits'] (asked for by the trainer) is not computed by fusedhead for "
            f"a model with final_logit_softcapping={softcap}: the mean of capped logits needs "
            "every logit; keep TRL's own kernel for this trainer and model"
        )
    utils = _trl_utils()
    output_cls = utils.FusedCausalLMOutput
    previous = model.forward
    scale = _logit_scale(text_config)
    entropy = "entropy" in wanted
    sum_sq, top1, mean = "log_sum_sq_probs" in wanted, "is_top1" in wanted, "mean_logits" in wanted
    temp = float(temperature)

    # functools.wraps keeps the model class's signature: `generate` checks kwargs against it.
    @functools.wraps(type(model).forward)
    def forward(
        self: nn.Module,
        *args: Any,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: Any = None,
        **kwargs: Any,
    ) -> Any:
        if not fused_lm_head:
            for name, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    kwargs[name] = value
            return previous(*args, **kwargs)
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs labels (or shift_labels)")
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        body_out = _backbone(self, text_config)(*args, **kwargs)
        hidden = body_out.last_hidden_state
        if shift_labels is None:
            assert labels is not None
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        lm_head: nn.Module = self.get_output_embeddings()  # type: ignore[operator]
        device: torch.device = lm_head.weight.device  # type: ignore[assignment]
        hidden, targets = hidden.to(device), targets.to(device)
        pending = _PENDING_POLICY_LOSS.get()
        if pending is not None:
            return _policy_loss_forward(
                pending,
                output_cls,
                lm_head,
                hidden,
                targets,
                head=fused,
                temperature=temp,
                softcap=softcap,
                logit_scale=scale,
                compute_dtype=torch.float32 if cast_lm_head_to_fp32 else None,
                aux_loss=(
                    _load_balancing_loss(self, text_config, body_out, kwargs)
                    if kwargs.get("output_router_logits")
                    else None
                ),
            )
        rows: list[torch.Tensor] = []

        def mean_row(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
            # mean_v (s * (h . W_v + b_v)) / T == s * (h . mean_v W_v + mean_v b_v) / T
            with torch.no_grad():
                w = weight.detach().float().mean(0)
                b = (
                    torch.zeros((), device=w.device)
                    if bias is None
                    else bias.detach().float().mean()
                )
                rows.append(((hidden.detach().float() @ w + b) * (scale / temp)).float())

        out = lm_head_logprobs(
            lm_head,
            hidden,
            targets,
            head=fused,
            temperature=temp,
            return_entropy=entropy,
            softcap=softcap,
            logit_scale=scale,
            compute_dtype=torch.float32 if cast_lm_head_to_fp32 else None,
            return_sum_p2=sum_sq,
            return_argmax=top1,
            on_weight=mean_row if mean else None,
        )
        mask = targets != -100
        # TRL's statistics: no gradient, 0 / False where the label is -100.
        log_sum_sq_probs = None
        if out.sum_p2 is not None:
            log_sum_sq_probs = out.sum_p2.detach().log().masked_fill(~mask, 0.0)
        # TRL: the label's logit is the maximum and no lower id reaches it (the lower id on
        # ties), which is the backend's argmax.
        is_top1 = None if out.argmax is None else (out.argmax == targets) & mask
        mean_logits = rows[0].masked_fill(~mask, 0.0) if rows else None
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -out.log_probs.sum() / denom
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _load_balancing_loss(self, text_config, body_out, kwargs)
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return output_cls(
            loss=loss,
            log_probs=out.log_probs,
            entropy=out.entropy,
            log_sum_sq_probs=log_sum_sq_probs,
            mean_logits=mean_logits,
            is_top1=is_top1,
            label_mask=mask,
            aux_loss=aux_loss,
        )

    setattr(forward, _MARK, fused)
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


def fused_head_of(forward: object) -> FusedHead | None:
    """The ``FusedHead`` behind a forward (or a model's) that :func:`add_fused_lm_head` installed."""
    if isinstance(forward, nn.Module):
        forward = forward.forward
    head = getattr(getattr(forward, "__func__", forward), _MARK, None)
    return head if isinstance(head, FusedHead) else None


def _load_balancing_loss(
    model: nn.Module, text_config: Any, body_out: Any, kwargs: Mapping[str, Any]
) -> torch.Tensor:
    """MoE load-balancing loss as the model's own forward adds it (Mixtral's formula)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = getattr(text_config, "num_experts", None) or getattr(model, "num_experts", None)
    per_token = getattr(text_config, "num_experts_per_tok", None) or getattr(
        model, "num_experts_per_tok", None
    )
    loss: torch.Tensor = load_balancing_loss_func(  # type: ignore[assignment]
        body_out.router_logits, experts, per_token, kwargs.get("attention_mask")
    )
    return loss


def _trl_fused_closure(forward: object) -> dict[str, Any] | None:
    """The arguments TRL's ``add_fused_lm_head`` was given, read from the forward it installed."""
    fn = getattr(forward, "__func__", forward)
    # Unwrap accelerate's autocast/fp32-output wrappers, stopping at TRL's own function (whose
    # __wrapped__ is the model class's forward, kept by functools.wraps).
    while callable(fn):
        code = getattr(fn, "__code__", None)
        if (
            code is not None
            and code.co_name == "_fused_forward"
            and code.co_filename.replace("\\", "/").endswith("trl/trainer/utils.py")
        ):
            nonlocals = inspect.getclosurevars(fn).nonlocals
            if not {"temperature", "cast_lm_head_to_fp32", "outputs"} <= set(nonlocals):
                raise RuntimeError(
                    "TRL's fused LM head no longer keeps (temperature, cast_lm_head_to_fp32, "
                    f"outputs); fusedhead.integrations.trl was tested with TRL {TESTED_TRL}"
                )
            return dict(nonlocals)
        fn = getattr(fn, "__wrapped__", None)
    return None


def replace_trl_fused_heads(trainer: Any, head: HeadLike) -> list[nn.Module]:
    """Give every model of ``trainer`` that carries TRL's fused head fusedhead's instead.

    The temperature, fp32 setting and outputs are the ones the trainer passed to TRL's
    ``add_fused_lm_head``. Returns the models switched; raises when there is none (the trainer
    does not use TRL's fused head, or TRL changed how it installs it).
    """
    fused = resolve_lm_head(head)
    candidates: list[nn.Module] = []
    for attr in ("model", "ref_model", "teacher_model"):
        m = getattr(trainer, attr, None)
        if isinstance(m, nn.Module):
            get_base = getattr(m, "get_base_model", None)
            candidates += [m, get_base()] if callable(get_base) else [m]
    switched: list[nn.Module] = []
    for m in {id(c): c for c in candidates}.values():
        if fused_head_of(m) is not None:
            switched.append(m)  # already fusedhead's
            continue
        args = _trl_fused_closure(m.__dict__.get("forward"))
        if args is None:
            continue
        if args.get("logit_scale", 1.0) != _logit_scale(_text_config(m)):
            raise RuntimeError(
                f"TRL scales {type(m).__name__}'s logits by {args['logit_scale']}, fusedhead read "
                f"{_logit_scale(_text_config(m))}; refusing to score a different distribution"
            )
        add_fused_lm_head(
            m,
            temperature=args["temperature"],
            cast_lm_head_to_fp32=args["cast_lm_head_to_fp32"],
            outputs=tuple(args["outputs"]),
            head=fused,
        )
        switched.append(m)
    if not switched:
        raise RuntimeError(
            f"{type(trainer).__name__} has no model with TRL's fused LM head (add_fused_lm_head); "
            f"fusedhead.integrations.trl was tested with TRL {TESTED_TRL}"
        )
    return switched


def fused_head_from_args(args: Any) -> HeadLike:
    """The head named by a trainer config's ``fused_head_backend`` / ``fused_head_options``.

    ``fused_head_backend`` is a backend name (``"triton"``) or ``"fusedhead:<name>"``;
    ``fused_head_options`` a mapping or its JSON text (the backend's own options).
    """
    name = getattr(args, "fused_head_backend", None)
    if name is None:
        raise ValueError(
            f"{type(args).__name__} has no fused_head_backend: use fusedhead's config class for "
            "the trainer (FusedHeadGRPOConfig, FusedHeadRLOOConfig, FusedHeadSFTConfig, "
            "FusedHeadDPOConfig, FusedHeadKTOConfig), or pass fused_head='triton' (a backend "
            "name) to the trainer"
        )
    options = getattr(args, "fused_head_options", None)
    if isinstance(options, str):
        try:
            options = load_json(options)
        except ValueError as exc:  # malformed, or a key given twice
            raise ValueError(f"fused_head_options is not valid JSON: {options!r} ({exc})") from None
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"fused_head_options must be a mapping or JSON text, got {type(options).__name__}"
        )
    if not options:
        return str(name)
    spec = str(name)
    backend = parse_backend_spec(spec, setting=_FIELD) if is_fusedhead_spec(spec) else spec
    return {"backend": backend, "options": dict(options)}


#: The config field and the trainer keyword that name the backend.
_FIELD, _KEYWORD = "fused_head_backend", "fused_head"


def _named_by(args: Any, fused_head: HeadLike) -> tuple[HeadLike, str, object]:
    """``(head, setting, value)``: what names the backend (the ``fused_head=`` keyword, else the
    config's ``fused_head_backend``), that setting's name and its value as the user wrote it."""
    if fused_head is not None:
        shown = fused_head.name if isinstance(fused_head, FusedHead) else fused_head
        return fused_head, _KEYWORD, shown
    return fused_head_from_args(args), _FIELD, getattr(args, _FIELD, None)


def _options_via(setting: str) -> str:
    """How a backend's options are passed beside ``setting``."""
    if setting == _KEYWORD:
        return "fused_head={'backend': '<name>', 'options': {...}} (a mapping)"
    return 'fused_head_options (JSON text, e.g. fused_head_options=\'{"key": "value"}\')'


def resolve_named(args: Any, fused_head: HeadLike = None) -> tuple[FusedHead, str, object]:
    """The head the trainer keyword ``fused_head`` (else ``args.fused_head_backend``) names,
    resolved; an unknown or malformed name is reported as that setting's value. Returns
    ``(head, setting, value)``."""
    head, setting, value = _named_by(args, fused_head)
    try:
        return resolve_lm_head(head, setting=setting, value=value), setting, value
    except OptionsError as exc:
        if setting != _FIELD:
            raise
        # the options came from the config's fused_head_options: name that setting too
        exc.reason = (
            f"fused_head_options={getattr(args, 'fused_head_options', None)!r}: {exc.reason}"
        )
        raise


def trainer_device(args: Any) -> tuple[torch.device, torch.dtype | None]:
    """Where a TRL config's heads will run: (device, dtype), read without building the trainer.

    The CPU under ``use_cpu`` or without CUDA, else CUDA; bf16 / fp16 under ``bf16`` / ``fp16``
    unless ``cast_lm_head_to_fp32``, else None (the model's own dtype: the device alone is checked).
    """
    device = torch.device(
        "cpu" if getattr(args, "use_cpu", False) or not torch.cuda.is_available() else "cuda"
    )
    dtype: torch.dtype | None = None
    if not getattr(args, "cast_lm_head_to_fp32", False):
        if getattr(args, "bf16", False):
            dtype = torch.bfloat16
        elif getattr(args, "fp16", False):
            dtype = torch.float16
    return device, dtype


def check_args_device(
    args: Any, head: HeadLike = None, *, setting: str | None = None, value: object = None
) -> FusedHead:
    """Resolve the head ``args`` (or ``head``) names and check it runs where ``args`` trains.

    Raised when a FusedHead*Config or trainer is built, before any model is loaded:
    ``BackendUnavailableError`` naming the setting that named the backend (``setting``, default
    ``fused_head_backend``; the trainer's ``fused_head=`` keyword is ``fused_head``), its
    ``value`` as written, the device and the fix.
    """
    if head is None:
        fused, setting, value = resolve_named(args)
    else:
        setting = setting or _FIELD
        fused = resolve_lm_head(head, setting=setting, value=value)
    device, dtype = trainer_device(args)
    check_head_runs_on(
        fused,
        device,
        dtype,
        setting=setting,
        value=fused.name if value is None else value,
        options_via=_options_via(setting),
    )
    return fused


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
class _PendingPolicyLoss:
    """What the trainer asks of the policy's next fused forward: the loss's keywords (per-token
    tensors of the completion, ``[B, keep]``), the completion length and the loss mask."""

    spec: dict[str, Any]
    keep: int
    loss_mask: torch.Tensor
    result: PolicyLossOutput | None = None


#: Set by :func:`grpo_fused_policy_loss` around TRL's per-token forward of the policy.
_PENDING_POLICY_LOSS: contextvars.ContextVar[_PendingPolicyLoss | None] = contextvars.ContextVar(
    "fusedhead_trl_policy_loss", default=None
)


def _policy_loss_forward(
    pending: _PendingPolicyLoss,
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
    args: Any, head: FusedHead | None = None, *, setting: str = _FIELD
) -> None:
    """Refuse, by name, a GRPO config whose loss ``fused_policy_loss`` does not compute.

    Called when a ``FusedHeadGRPOConfig`` with ``fused_policy_loss=True`` (and its trainer) is
    built. Each refusal is a ``ValueError`` naming the setting, its value and what maps; a
    backend that does not declare ``policy_loss`` on the trainer's device is a
    ``CapabilityError``.
    """
    if not getattr(args, "fused_policy_loss", False):
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
        raise CapabilityError(
            f"fused_policy_loss=True needs a backend that declares policy_loss on "
            f"{device.type}; {fused.name!r} does not",
            capability="policy_loss",
            hint=f"name one in {setting} (e.g. 'torch', or 'triton' on a GPU), or set "
            "fused_policy_loss=False",
            backend=fused.name,
            distribution=fused.distribution,
            version=fused.version,
        )


def grpo_fused_policy_loss(trainer: Any, model: nn.Module, inputs: Mapping[str, Any]) -> Any:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` with the loss from ``fused_policy_loss``.

    The policy's forward runs through TRL's own ``_get_per_token_logps_and_entropies`` (its
    inputs, multimodal ones included); the fused forward installed by :func:`add_fused_lm_head`
    sees the pending loss and computes it from the hidden states in three GEMMs per chunk. The
    loss, its scaling for gradient accumulation and every metric TRL logs are TRL's.
    """
    from accelerate.utils import gather

    utils = _trl_utils()
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
    pending = _PendingPolicyLoss(spec, keep, mask)
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


class FusedPolicyLossMixin:
    """Put before ``FusedHeadTrainerMixin`` on a GRPO trainer: with ``args.fused_policy_loss``
    the loss is :func:`grpo_fused_policy_loss` (checked by :func:`check_policy_loss_args`
    before TRL's init), else TRL's own ``_compute_loss``."""

    args: Any

    def __init__(self, *args: Any, fused_head: HeadLike = None, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        config = bound.arguments.get("args")
        if getattr(config, "fused_policy_loss", False):
            head, setting, _ = resolve_named(config, fused_head)
            check_policy_loss_args(config, head, setting=setting)
        super().__init__(*args, fused_head=fused_head, **kwargs)  # type: ignore[call-arg]

    def _compute_loss(self, model: nn.Module, inputs: Mapping[str, Any]) -> Any:
        if not getattr(self.args, "fused_policy_loss", False):
            return super()._compute_loss(model, inputs)  # type: ignore[misc]
        return grpo_fused_policy_loss(self, model, inputs)


class FusedHeadTrainerMixin:
    """Put before a TRL trainer class: its fused LM heads run on the fusedhead backend named
    by ``fused_head=`` or by ``args.fused_head_backend``; ``self.fused_head`` is the head."""

    fused_head: FusedHead

    def __init__(self, *args: Any, fused_head: HeadLike = None, **kwargs: Any) -> None:
        # read (and check) the config before the trainer's costly init: the backend must run on
        # the device the trainer will use
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        config = bound.arguments.get("args")
        head, setting, value = resolve_named(config, fused_head)
        if config is not None:
            check_args_device(config, head, setting=setting, value=value)
        super().__init__(*args, **kwargs)
        self.fused_head = head
        replace_trl_fused_heads(self, head)


@dataclass
class _FusedHeadFields:
    """The config fields the FusedHead*Config classes add to TRL's."""

    fused_head_backend: str = field(
        default="torch",
        metadata={"help": "fusedhead backend: a name ('triton') or 'fusedhead:<name>'."},
    )
    fused_head_options: str | None = field(
        default=None,
        metadata={"help": "The backend's options as JSON text (or a dict in Python)."},
    )


@dataclass
class _FusedPolicyLossFields:
    """The config field FusedHeadGRPOConfig adds: the loss from ``fused_policy_loss``."""

    fused_policy_loss: bool = field(
        default=False,
        metadata={
            "help": "Compute the GRPO loss with fusedhead.fused_policy_loss (loss types grpo, "
            "bnpo, dr_grpo, dapo): its gradients in the forward, three GEMMs per chunk."
        },
    )


_BUILT: dict[str, Any] = {}
_TRAINERS = {
    "GRPO": "GRPOTrainer",
    "RLOO": "RLOOTrainer",
    "SFT": "SFTTrainer",
    "DPO": "DPOTrainer",
    "KTO": "KTOTrainer",
}


def _build(name: str) -> Any:
    """``FusedHead{GRPO,RLOO}{Trainer,Config}``, made on first use (imports TRL)."""
    _trl_utils()
    import trl

    kind, what = name[len("FusedHead") : -len("Trainer")], "Trainer"
    if name.endswith("Config"):
        kind, what = name[len("FusedHead") : -len("Config")], "Config"
    base = getattr(trl, f"{kind}{what}")
    cls: Any
    if what == "Config":

        def __post_init__(self: Any) -> None:
            base.__post_init__(self)
            head = check_args_device(self)  # fail when the config is built, not at the first step
            check_policy_loss_args(self, head)

        fields: tuple[type, ...] = (_FusedHeadFields,)
        if kind == "GRPO":
            fields += (_FusedPolicyLossFields,)
        cls = dataclass(
            type(
                name,
                (base, *fields),
                {"__module__": __name__, "__post_init__": __post_init__},
            )
        )
    else:
        mixins: tuple[type, ...] = (FusedHeadTrainerMixin,)
        if kind == "GRPO":
            mixins = (FusedPolicyLossMixin, *mixins)
        cls = type(name, (*mixins, base), {"__module__": __name__})
    cls.__doc__ = (
        f"TRL's {base.__name__} with its fused LM head on a fusedhead backend ({__name__})."
    )
    return cls


_LAZY = {f"FusedHead{k}{w}" for k in _TRAINERS for w in ("Trainer", "Config")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        _BUILT[name] = _build(name)
    return _BUILT[name]
