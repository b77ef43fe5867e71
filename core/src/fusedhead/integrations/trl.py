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

The fields take effect only through the trainer classes (the mixins' ``__init__``): TRL's stock
``GRPOTrainer`` given a ``FusedHeadGRPOConfig`` reads none of them and would train on TRL's own
kernel and loss. The configs therefore refuse, with a ``TypeError``, to be read by a trainer whose
``FusedHeadTrainerMixin.__init__`` is not running. TRL has no plugin point where a config could
see which trainer reads it, so the check lives in the one method of the config that
``transformers.Trainer.__init__`` always calls on it, ``get_process_log_level`` (transformers
5.22; before the device setup and the model placement): the caller's frame, if it is
``transformers.Trainer.__init__`` reading this very config, names the trainer. Called from
anywhere else (the user, DeepSpeed's setup), or where frames cannot be read, it checks nothing
(fails open) and returns TRL's value. TRL's trainers letting the config choose the LM-head kernel
(``docs/integrations/trl.md``, "The upstream change") would remove the check with the mixin.
Bases that cannot honour a field are refused when the trainer is built:
``fused_policy_loss=True`` without ``FusedPolicyLossMixin`` before ``FusedHeadTrainerMixin``.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusedhead.api import FusedHead
from fusedhead.integrations.backend_spec import (
    HeadLike,
    refuse_decided_settings,
    resolve_lm_head,
)
from fusedhead.integrations.lm_head import lm_head_logprobs
from fusedhead.integrations.logit_transforms import model_logit_transform
from fusedhead.integrations.trl_config import (
    BACKEND_FIELD,
    TESTED_TRL,
    check_args_device,
    config_argument,
    fused_head_from_args,
    resolve_named,
    trainer_device,
    trl_utils,
)
from fusedhead.integrations.trl_policy_loss import (
    POLICY_LOSS_TYPES,
    FusedPolicyLossFields,
    FusedPolicyLossMixin,
    check_policy_loss_args,
    grpo_fused_policy_loss,
    pending_policy_loss,
    policy_loss_forward,
)
from fusedhead.module import decoder_body

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

#: ``FusedCausalLMOutput`` fields fusedhead computes: ``is_top1`` from the backend's argmax,
#: ``log_sum_sq_probs`` from its sum of squared probabilities, ``mean_logits`` (a DPO / KTO
#: metric) from the mean weight row, as the mean logit is linear in it (not under a softcap).
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_TRL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: Marks a forward installed here (the installing head is the value).
_MARK = "__fusedhead_head__"


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


def _logit_scale(model: nn.Module) -> float:
    """The multiplier a model applies to its logits before any softcap (1.0 for most models)."""
    return model_logit_transform(getattr(model, "config", None))[0]


def _backbone(model: nn.Module, text_config: Any) -> nn.Module:
    """The decoder body: ``model.base_model`` (vision-language models on transformers < 5:
    ``.model``); a text-only causal LM whose ``base_model_prefix`` names no attribute of its own
    (Llama 4's and Mllama's ``language_model``: ``base_model`` is the LM itself) by
    ``decoder_body``."""
    import transformers
    from packaging.version import Version

    text_only = text_config is getattr(model, "config", None)
    if not text_only and Version(transformers.__version__) < Version("5.0.0"):
        body = getattr(model, "model", None)
    else:
        body = getattr(model, "base_model", None)
    if text_only and (body is model or not isinstance(body, nn.Module)):
        return decoder_body(model)
    if not isinstance(body, nn.Module) or body is model:
        raise ValueError(
            f"cannot find the backbone of {type(model).__name__} (base_model); pass a causal LM"
        )
    return body


#: The head settings TRL's fused LM head call decides, and who decides them.
DECIDED_BY = {
    "temperature": "the trainer's temperature (TRL's config temperature)",
    "softcap": "the model's config (final_logit_softcapping)",
    "ignore_index": "TRL's labels (-100)",
    "return_entropy": "the outputs TRL's trainer asks of its fused LM head",
}


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
    refuse_decided_settings(fused, "head", DECIDED_BY)
    text_config = _text_config(model)
    # the model's scale and softcap as its forward applies them after its decoder, decided by
    # the model's own type (a wrapper's, whose head may ignore its text config's); a transform
    # fusedhead cannot reproduce is refused here
    scale, softcap = model_logit_transform(getattr(model, "config", None))
    if "mean_logits" in wanted and softcap is not None:
        raise ValueError(
            f"outputs ['mean_logits'] (asked for by the trainer) is not computed by fusedhead for "
            f"a model with a logit softcap ({softcap:g}): the mean of capped logits needs "
            "every logit; keep TRL's own kernel for this trainer and model"
        )
    utils = trl_utils()
    output_cls = utils.FusedCausalLMOutput
    previous = model.forward
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
        pending = pending_policy_loss()
        if pending is not None:
            return policy_loss_forward(
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
    refuse_decided_settings(fused, "head", DECIDED_BY)
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
        if args.get("logit_scale", 1.0) != _logit_scale(m):
            raise RuntimeError(
                f"TRL scales {type(m).__name__}'s logits by {args['logit_scale']}, but the model's "
                f"forward by {_logit_scale(m)}; refusing to score a different distribution"
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


#: ``id`` of each trainer whose ``FusedHeadTrainerMixin.__init__`` is running: the TRL (and
#: transformers) ``__init__`` under it may read a FusedHead*Config.
_BUILDING: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar(
    "fusedhead_trl_building", default=()
)
_GRPO_BASES = "FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer"


def _check_bases(cls: type, config: Any) -> None:
    """Refuse trainer bases that would leave a field of ``config`` unread: ``fused_policy_loss``
    needs ``FusedPolicyLossMixin`` before ``FusedHeadTrainerMixin`` (its ``_compute_loss``)."""
    mro, name = cls.__mro__, cls.__name__
    if FusedPolicyLossMixin in mro and mro.index(FusedPolicyLossMixin) > mro.index(
        FusedHeadTrainerMixin
    ):
        raise TypeError(
            f"{name} has FusedHeadTrainerMixin before FusedPolicyLossMixin in its bases; "
            f"FusedPolicyLossMixin goes first: class {name}({_GRPO_BASES})"
        )
    enabled = getattr(config, "fused_policy_loss", False)
    if enabled is not False and FusedPolicyLossMixin not in mro:
        raise TypeError(
            f"{name} was given fused_policy_loss={enabled!r}, but has no FusedPolicyLossMixin in "
            "its bases: TRL's own _compute_loss would run and the fused policy loss never would. "
            f"Add FusedPolicyLossMixin before FusedHeadTrainerMixin: class {name}({_GRPO_BASES}), "
            "or build FusedHeadGRPOTrainer (or set fused_policy_loss=False for TRL's own loss)"
        )


class FusedHeadTrainerMixin:
    """Put before a TRL trainer class: its fused LM heads run on the fusedhead backend named
    by ``fused_head=`` or by ``args.fused_head_backend``; ``self.fused_head`` is the head.
    On GRPO with ``fused_policy_loss``, ``FusedPolicyLossMixin`` goes before it:
    ``class MyGRPOTrainer(FusedPolicyLossMixin, FusedHeadTrainerMixin, trl.GRPOTrainer)``."""

    fused_head: FusedHead

    def __init__(self, *args: Any, fused_head: HeadLike = None, **kwargs: Any) -> None:
        # read (and check) the config before the trainer's costly init: the backend must run on
        # the device the trainer will use, and the bases must honour every field set
        config = config_argument(self, FusedHeadTrainerMixin, args, kwargs)
        _check_bases(type(self), config)
        head, setting, value = resolve_named(config, fused_head)
        refuse_decided_settings(head, setting, DECIDED_BY)
        if config is not None:
            check_args_device(config, head, setting=setting, value=value)
        token = _BUILDING.set((*_BUILDING.get(), id(self)))
        try:
            super().__init__(*args, **kwargs)
        finally:
            _BUILDING.reset(token)
        self.fused_head = head
        replace_trl_fused_heads(self, head)


def _trainer_reading(config: Any) -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` reads ``config`` now: the caller of its
    ``get_process_log_level`` (past overrides calling ``super()``), if that is
    ``transformers.Trainer.__init__`` with ``args`` being ``config``; else None."""
    frame = inspect.currentframe()
    caller = frame.f_back if frame is not None else None
    try:
        while caller is not None and caller.f_code.co_name in (
            "_check_read_by_fusedhead_trainer",
            "get_process_log_level",
        ):
            caller = caller.f_back
        if (
            caller is None
            or caller.f_code.co_name != "__init__"
            or caller.f_globals.get("__name__") != "transformers.trainer"
        ):
            return None
        local = caller.f_locals
        trainer, args = local.get("self"), local.get("args")
    finally:
        del frame, caller  # no reference cycle through the frames
    import transformers

    return trainer if args is config and isinstance(trainer, transformers.Trainer) else None


def _check_read_by_fusedhead_trainer(config: Any, kind: str) -> None:
    """Refuse ``config`` (a FusedHead{kind}Config) to a trainer that would ignore its fields."""
    trainer = _trainer_reading(config)
    if trainer is None or id(trainer) in _BUILDING.get():
        return
    fields = [f"{BACKEND_FIELD}={getattr(config, BACKEND_FIELD, None)!r}"]
    if getattr(config, "fused_head_options", None) is not None:
        fields.append(f"fused_head_options={config.fused_head_options!r}")
    policy_loss = getattr(config, "fused_policy_loss", False) is not False
    if policy_loss:
        fields.append(f"fused_policy_loss={config.fused_policy_loss!r}")
    name = type(trainer).__name__
    if isinstance(trainer, FusedHeadTrainerMixin):
        why = (
            f"{name}'s FusedHeadTrainerMixin.__init__ does not run (the mixin comes after the "
            "trainer class in its bases, or its __init__ skips super().__init__)"
        )
    else:
        why = f"{name} is not a fusedhead trainer and TRL reads none of these fields"
    mixins = (
        "FusedPolicyLossMixin, FusedHeadTrainerMixin" if kind == "GRPO" else "FusedHeadTrainerMixin"
    )
    raise TypeError(
        f"{name} was given a {type(config).__name__} ({', '.join(fields)}), but {why}: it would "
        f"train with TRL's own fused LM head{' and loss' if policy_loss else ''}. Build "
        f"FusedHead{kind}Trainer (fusedhead.integrations.trl) instead, or give your own subclass "
        f"these bases, in this order: class My{kind}Trainer({mixins}, trl.{kind}Trainer)"
    )


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
    trl_utils()
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

        def get_process_log_level(self: Any) -> int:
            """TRL's log level; first, when ``transformers.Trainer.__init__`` is the caller,
            refuse a trainer that would ignore this config's fields (see the module's doc)."""
            _check_read_by_fusedhead_trainer(self, kind)
            level: int = base.get_process_log_level(self)
            return level

        fields: tuple[type, ...] = (_FusedHeadFields,)
        if kind == "GRPO":
            fields += (FusedPolicyLossFields,)
        namespace = {
            "__module__": __name__,
            "__post_init__": __post_init__,
            "get_process_log_level": get_process_log_level,
        }
        cls = dataclass(type(name, (base, *fields), namespace))
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
__all__ += sorted(_LAZY)  # built on first use: `import *` builds them (and imports TRL)


def __dir__() -> list[str]:
    """The module's names and the trainer classes built on first use (tab completion)."""
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        _BUILT[name] = _build(name)
    return _BUILT[name]
