"""verl's actor loss from its config: ``actor_rollout_ref.actor.policy_loss.loss_mode: fusedhead``.

verl 0.9.1's actor (``ActorRolloutRefWorker`` -> ``TrainingWorker`` -> the FSDP engine) computes
its loss as ``partial(ppo_loss, config=actor_config)``, called by
``FSDPEngineWithLMHead.forward_step`` with the model's log-probs: a loss function never sees the
hidden states. Two pieces make ``loss_mode: fusedhead`` compute the whole loss with
:func:`fusedhead.fused_policy_loss` from the hidden states (three GEMMs, no logits):

- verl's own registry: ``register_policy_loss("fusedhead")`` (so verl's config accepts the name);
  what it registers is verl's vanilla loss on log-probs, used only where no gradient is taken
  (metrics of a forward-only pass); a training step that reaches it raises, naming why;
- the patch (``fusedhead.integrations.verl.enable_fused_policy_loss``): ``FSDPEngineWithLMHead.forward_step`` wrapped.
  For a training micro-batch whose loss function carries an actor config with
  ``loss_mode: fusedhead``, fusedhead's model forward (``impl_backend: fusedhead:<name>``) hands
  over the hidden states instead of scoring them, and :func:`fused_ppo_loss_step` replaces verl's
  ``ppo_loss``, with verl's metric names and aggregation. Every other call is verl's, unchanged.

Both are armed by :func:`fusedhead.integrations.verl.install` (the ``verl.plugins`` entry point)
when verl imports the two modules. What verl's actor config maps to, and what it is refused for
(:func:`~fusedhead.integrations.verl_config.policy_loss_kwargs`,
:func:`~fusedhead.integrations.verl_config.check_fused_setup`), is
:mod:`fusedhead.integrations.verl_config`. Nothing here imports torch or verl at import time.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from fusedhead.integrations.verl_config import (
    agg_mode,
    check_actor_config,
    check_fused_setup,
    loss_mode_of,
    option,
    policy_loss_kwargs,
    rollout_is_kwargs,
)

__all__ = [
    "ACTOR_CONFIG_MODULE",
    "CORE_ALGOS_MODULE",
    "FSDP_ENGINE_MODULE",
    "LOSS_MODE",
    "building_dtype",
    "disarm",
    "fused_ppo_loss_step",
    "fusedhead_policy_loss",
    "hand_over",
    "is_armed",
    "patched_model",
    "register_loss_mode",
    "set_enabled",
    "track_actor_configs",
    "weight_owner",
    "wrap_forward_step",
]

#: The ``actor.policy_loss.loss_mode`` value that selects the fused loss.
LOSS_MODE = "fusedhead"
#: verl's policy-loss registry (``register_policy_loss``).
CORE_ALGOS_MODULE = "verl.trainer.ppo.core_algos"
#: verl's FSDP engine, whose ``FSDPEngineWithLMHead.forward_step`` runs model and loss.
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
#: verl's actor config dataclasses (``ActorConfig``, whose ``__post_init__`` is wrapped).
ACTOR_CONFIG_MODULE = "verl.workers.config.actor"


@dataclasses.dataclass
class _Pending:
    """What fusedhead's model forward hands the fused loss instead of log-probs."""

    hidden: Any = None
    lm_head: Any = None
    head: Any = None
    labels: Any = None
    temperature: Any = 1.0
    logit_scale: float = 1.0  #: the model's own logit transform (``model_logit_transform``)
    softcap: float | None = None
    #: the engine's module (the FSDP2 root), under which :func:`weight_owner` finds the FSDP2
    #: unit that holds ``lm_head.weight``; None: the LM head itself
    root: Any = None

    def take(self) -> _Pending | None:
        if self.hidden is None:
            return None
        out = dataclasses.replace(self)
        self.hidden = self.lm_head = self.labels = None
        return out


_PENDING: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar(
    "fusedhead_verl_pending", default=None
)
_enabled = True
#: Models whose forward fusedhead's verl integration patched (``impl_backend: fusedhead:<name>``).
_PATCHED: weakref.WeakSet[Any] = weakref.WeakSet()


def patched_model(model: Any) -> None:
    """Record that ``model`` runs fusedhead's verl forward (called when verl patches it)."""
    _PATCHED.add(model)


def set_enabled(enable: bool) -> None:
    """Whether :func:`register_loss_mode` / :func:`wrap_forward_step` patch (and disarm if not)."""
    global _enabled
    _enabled = enable
    if not enable:
        disarm()


def is_armed() -> bool:
    """Whether the patches are on (or will be, when verl imports its modules)."""
    return _enabled


_NEEDS_FORWARD = (
    "policy_loss.loss_mode='fusedhead' needs fusedhead's model forward: set "
    "actor_rollout_ref.model.fused_kernel_options.impl_backend: fusedhead:<name> (with "
    "use_fused_kernels: true); this model's forward computes log-probs, not hidden states"
)
#: The dtype verl's FSDP engine computes in, while it builds its model (:func:`building_dtype`).
_BUILDING_DTYPE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "fusedhead_verl_building_dtype", default=None
)
#: Actor configs with ``loss_mode: fusedhead``, by id (weak: a config is not kept alive here).
_FUSED_CONFIGS: dict[int, weakref.ref[Any]] = {}
#: Engines whose setup :func:`check_fused_setup` has passed (checked once each).
_CHECKED: weakref.WeakSet[Any] = weakref.WeakSet()


def building_dtype() -> Any:
    """The torch dtype verl's FSDP engine computes in (its ``mixed_precision.param_dtype``,
    bf16 without one, as verl reads it) while that engine builds its model; None elsewhere."""
    return _BUILDING_DTYPE.get()


def hand_over(
    hidden: Any,
    lm_head: Any,
    head: Any,
    labels: Any,
    temperature: Any,
    transform: tuple[float, float | None] = (1.0, None),
) -> bool:
    """Called by fusedhead's verl forward: True when the fused loss takes the hidden states.
    ``transform``: the model's ``(logit_scale, softcap)``, applied as its own forward would."""
    slot = _PENDING.get()
    if slot is None or slot.hidden is not None:
        return False
    slot.hidden, slot.lm_head, slot.head = hidden, lm_head, head
    slot.labels, slot.temperature = labels, temperature
    slot.logit_scale, slot.softcap = transform
    return True


def _fused_config_of(model_config: Any) -> Any:
    """The live actor config with ``loss_mode: fusedhead`` whose ``model_config`` is this one."""
    for ref in list(_FUSED_CONFIGS.values()):
        config = ref()
        if config is not None and option(config, "model_config") is model_config:
            return config
    return None


def _check_built(engine: Any) -> None:
    """:func:`check_fused_setup` for the engine's model, once per engine, where an actor config
    with ``loss_mode: fusedhead`` holds that model config."""
    if engine in _CHECKED:
        return
    model_config = getattr(engine, "model_config", None)
    config = None if model_config is None else _fused_config_of(model_config)
    if config is not None:  # else checked again at the next forward (a config may come later)
        check_fused_setup(config, model_config, getattr(engine, "engine_config", None))
        _CHECKED.add(engine)


def _engine_dtype(engine: Any) -> Any:
    """The dtype verl's FSDP engine computes in: ``mixed_precision.param_dtype`` (bf16 when
    unset, and without a mixed-precision config), as its ``_build_fsdp_module`` reads it."""
    import torch
    from verl.utils.torch_dtypes import PrecisionType

    mixed = option(getattr(engine, "engine_config", None), "mixed_precision", None)
    if mixed is None:
        return torch.bfloat16
    to_dtype: Any = PrecisionType.to_dtype  # untyped in verl
    return to_dtype(option(mixed, "param_dtype", "bf16"))


def _wrap_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check_built(self)  # before the model is loaded
        token = _BUILDING_DTYPE.set(_engine_dtype(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            _BUILDING_DTYPE.reset(token)

    initialize.__fusedhead_original__ = original  # type: ignore[attr-defined]
    return initialize


def _wrap_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        mode = loss_mode_of(self)
        fused = _enabled and mode == LOSS_MODE
        if fused:
            agg_mode(self)  # before verl's own check, which lists no valid value
        elif _enabled:
            _refuse_misspelt_mode(mode)
        original(self)
        if not fused:
            return
        check_actor_config(self)  # what maps is checked when the config is built, by verl's names
        key = id(self)

        def forget(ref: weakref.ref[Any]) -> None:
            if _FUSED_CONFIGS.get(key) is ref:
                del _FUSED_CONFIGS[key]

        _FUSED_CONFIGS[key] = weakref.ref(self, forget)

    __post_init__.__fusedhead_original__ = original  # type: ignore[attr-defined]
    return __post_init__


def _refuse_misspelt_mode(mode: object) -> None:
    """A ``loss_mode`` meant for fusedhead but misspelt (``fused_head``, ``fusedHead``) and not a
    mode verl registered: refused when the config is built, not at the first training step."""
    core = sys.modules.get(CORE_ALGOS_MODULE)
    known = list(getattr(core, "POLICY_LOSS_REGISTRY", {})) if core is not None else []
    if not isinstance(mode, str) or mode in known:
        return
    from fusedhead.integrations.backend_spec import is_misspelt_spec  # torch: not at import time

    if is_misspelt_spec(mode, known) or mode.lower() == LOSS_MODE:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r} is not one of verl's loss "
            f"modes: did you mean {LOSS_MODE!r} (the policy loss computed inside fusedhead's "
            "head)?"
        )


def track_actor_configs(module: types.ModuleType) -> None:
    """Wrap verl's ``ActorConfig.__post_init__`` (idempotent): a config with ``loss_mode:
    fusedhead`` is checked when built and remembered (weakly) for its engine's build."""
    cls = module.ActorConfig
    current = cls.__dict__["__post_init__"]
    if _enabled and not hasattr(current, "__fusedhead_original__"):
        cls.__post_init__ = _wrap_post_init(current)


def _fused_config(loss_function: Any) -> Any:
    """The actor config of a ``partial(ppo_loss, config=...)`` asking for the fused loss, or None."""
    keywords = getattr(loss_function, "keywords", None)
    config = keywords.get("config") if isinstance(keywords, dict) else None
    if config is None or loss_mode_of(config) != LOSS_MODE:
        return None
    from verl.workers.utils.losses import ppo_loss

    func = getattr(loss_function, "func", None)
    if func is not ppo_loss:
        name = getattr(func, "__name__", repr(func))
        raise ValueError(
            f"policy_loss.loss_mode='fusedhead' replaces verl's ppo_loss; the actor's loss here "
            f"is {name} (distillation?), which the fused loss does not compute: use loss_mode "
            "'vanilla' with it"
        )
    return config


def _wrap_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        _check_built(self)  # the first forward, whatever the pass, if the build did not check
        _check_veomni_kernel_used(self, micro_batch)
        config = None if forward_only else _fused_config(loss_function)
        if config is None:
            return original(self, micro_batch, loss_function, forward_only)
        _check_engine(self, micro_batch, config)
        slot = _Pending(root=getattr(self, "module", None))
        token = _PENDING.set(slot)
        try:
            loss_fn = functools.partial(fused_ppo_loss_step, config=config, pending=slot)
            return original(self, micro_batch, loss_fn, forward_only)
        finally:
            _PENDING.reset(token)

    forward_step.__fusedhead_original__ = original  # type: ignore[attr-defined]
    return forward_step


#: The setting of verl's VeOmni engine that names its cross-entropy kernel.
VEOMNI_KERNEL_SETTING = "actor_rollout_ref.actor.veomni.cross_entropy_loss_implementation"


def _veomni_kernel(engine: Any) -> str | None:
    """The fusedhead kernel verl's VeOmni engine was configured with (None: another engine, or
    another kernel)."""
    if not type(engine).__module__.startswith("verl.workers.engine.veomni"):
        return None
    from fusedhead.integrations.backend_spec import is_fusedhead_spec

    impl = getattr(
        getattr(engine, "engine_config", None), "cross_entropy_loss_implementation", None
    )
    return impl if is_fusedhead_spec(impl) else None


def _check_veomni_kernel_used(engine: Any, micro_batch: Any) -> None:
    """verl's VeOmni engine calls its cross-entropy kernel only with use_fused_kernels and
    use_remove_padding; without them a fusedhead kernel is never called and the full logits are
    formed, without a word: refused by name."""
    impl = _veomni_kernel(engine)
    if impl is None:
        return
    from verl.utils import tensordict_utils as tu

    for key in ("use_fused_kernels", "use_remove_padding"):
        if not tu.get_non_tensor_data(
            data=micro_batch, key=key, default=key != "use_fused_kernels"
        ):
            raise ValueError(
                f"{VEOMNI_KERNEL_SETTING}={impl!r} has no effect with {key}=False: verl's VeOmni "
                "engine then computes the full logits and never calls the kernel; set "
                f"actor_rollout_ref.model.{key}: true, or drop the fusedhead kernel"
            )


def _check_engine(engine: Any, micro_batch: Any, config: Any) -> None:
    from verl.utils import tensordict_utils as tu

    if type(engine).__module__.startswith("verl.workers.engine.veomni"):
        raise RuntimeError(
            "policy_loss.loss_mode='fusedhead' runs on verl's FSDP engine (model_engine: dp) "
            "only: verl's VeOmni engine never applies fused_kernel_options.impl_backend, so its "
            "model's forward gives log-probs, not the hidden states the fused loss needs. With "
            f"the VeOmni engine, keep verl's loss_mode and take the log-probs from fusedhead by "
            f"{VEOMNI_KERNEL_SETTING}: fusedhead:<name>"
        )
    check_actor_config(config)
    flags = {
        "use_remove_padding": "actor_rollout_ref.model.use_remove_padding: true",
        "use_fused_kernels": "actor_rollout_ref.model.use_fused_kernels: true",
    }
    for key, fix in flags.items():
        if not tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
            raise ValueError(f"policy_loss.loss_mode='fusedhead' needs {fix} (got {key}=False)")
    if _patched_model_in(getattr(engine, "module", None)) is None:
        raise RuntimeError(_NEEDS_FORWARD)
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError(
            "policy_loss.loss_mode='fusedhead' with ulysses_sequence_parallel_size > 1: each "
            "rank holds a slice of the packed sequence; use loss_mode 'vanilla' with sequence "
            "parallelism"
        )


def _patched_model_in(module: Any) -> Any:
    """The model fusedhead's verl forward patched, found under the wrappers verl's engine puts
    around it (FSDP1's ``FullyShardedDataParallel``: ``.module``; PEFT's ``PeftModel`` for
    ``lora_rank > 0``: ``get_base_model()``; FSDP2 keeps the class), or None where there is none:
    the engine's module is the wrapper, not the model that was patched."""
    seen: set[int] = set()
    while module is not None and id(module) not in seen:
        if module in _PATCHED:
            return module
        seen.add(id(module))
        if type(module).__name__ == "FullyShardedDataParallel":
            module = getattr(module, "module", None)
        elif callable(getattr(type(module), "get_base_model", None)):
            module = module.get_base_model()
        else:
            return None
    return None


def _packed_response(data: Any, total: int, response_mask: Any) -> tuple[Any, Any]:
    """``(rows, mask)``: the packed row of each padded response slot ``[B, R]`` and whether it is
    scored, as verl's ``no_padding_2_padding`` slices (response ``j`` of sequence ``i`` is
    predicted at ``end_i - len_i - 1 + j``). ``response_mask``: padded ``[B, R]``, as verl's v1
    trainer hands it nested (one row per sample, of the sample's length)."""
    import torch

    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        prompt_lens, response_lens = prompts.offsets().diff(), responses.offsets().diff()
    else:
        mask = data["attention_mask"]
        prompt_lens = mask[:, : prompts.shape[1]].sum(dim=1)
        response_lens = mask[:, prompts.shape[1] :].sum(dim=1)
    ends = (prompt_lens + response_lens).cumsum(0)
    if int(ends[-1]) != total:
        raise ValueError(f"the packed micro-batch holds {total} tokens, its sequences {ends[-1]}")
    j = torch.arange(response_mask.shape[-1], device=ends.device)
    rows = (ends - response_lens - 1)[:, None] + j[None, :]
    scored = (j[None, :] < response_lens[:, None]) & response_mask.to(torch.bool)
    return rows, scored


def weight_owner(root: Any, lm_head: Any) -> Any:
    """The module in whose call the fused loss reads ``lm_head.weight``: the nearest FSDP2 unit
    (``FSDPModule``) at or above ``lm_head`` under ``root``, which is the unit FSDP2 gave that
    weight to; ``lm_head`` itself where it is its own unit, or where none is above it.

    verl's ``apply_fsdp2`` shards an untied ``lm_head`` on its own, but not a head tied to the
    input embeddings (Qwen2.5-0.5B..3B, Qwen3 small, Llama-3.2, Gemma): the root unit holds that
    weight, resharded after the model's forward (``reshard_after_forward: true``). Run inside
    the root's call, FSDP2's own hooks unshard it, reshard it after, unshard it again for the
    backward and reduce-scatter its gradient, the head's part summed with the embedding's.
    """
    from torch import nn

    from fusedhead.module import is_fsdp_module

    if not isinstance(root, nn.Module) or is_fsdp_module(lm_head):
        return lm_head
    path = next((name for name, module in root.named_modules() if module is lm_head), None)
    if path is None:  # not under this root: nothing to find it in
        return lm_head
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        module = root.get_submodule(".".join(parts[:depth]))
        if is_fsdp_module(module):
            return module
    return lm_head


def fused_ppo_loss_step(
    config: Any, model_output: dict[str, Any], data: Any, dp_group: Any = None, *, pending: Any
) -> tuple[Any, dict[str, Any]]:
    """verl 0.9.1's ``ppo_loss`` (vanilla policy loss, entropy bonus, KL loss) from the hidden
    states fusedhead's forward handed over: same loss, same metrics and aggregation types."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric

    from fusedhead.integrations.lm_head import in_module_call, lm_head_policy_loss
    from fusedhead.policy_output import PolicyLossOutput

    got = pending.take()
    if got is None:
        raise RuntimeError(_NEEDS_FORWARD)
    offsets = data["input_ids"].offsets()
    total = int(offsets[-1])
    hidden, rolled = got.hidden[:, :total], got.labels[:, :total]  # a static pad is a suffix
    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [k for k in ("rollout_is_weights", "ref_log_prob") if k in data]
    padded = data.select(*fields).to_padded_tensor()
    rows, scored = _packed_response(data, total, padded["response_mask"])
    at = rows[scored]

    def packed(name: str) -> torch.Tensor:
        out = torch.zeros(1, total, dtype=torch.float32, device=hidden.device)
        out[0, at] = padded[name][scored].to(torch.float32)
        return out

    labels = torch.full(rolled.shape, -100, dtype=torch.int64, device=rolled.device)
    labels[0, at] = rolled[0, at]
    calc_entropy = tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False)
    dp_size, num_tokens = data["dp_size"], data["batch_num_tokens"]
    batch_size = data["global_batch_size"]
    kwargs = policy_loss_kwargs(
        config,
        horizon=padded["response_mask"].shape[-1],
        dp_size=dp_size,
        batch_num_tokens=num_tokens,
        global_batch_size=batch_size,
    )
    if not calc_entropy:  # verl adds the entropy term only where the engine computed entropy
        kwargs["entropy_coef"] = 0.0
    old = packed("old_log_probs")
    if "kl_coef" in kwargs:
        kwargs["ref_log_probs"] = packed("ref_log_prob")
    if "rollout_is_weights" in fields:  # verl's w as exp(old - rollout), log w clamped to +-20
        kwargs.update(rollout_is_kwargs(old, packed("rollout_is_weights"), labels))
    names = [f.name for f in dataclasses.fields(PolicyLossOutput)]

    def body() -> tuple[Any, ...]:
        # a tuple of tensors, not the dataclass: FSDP2's post-forward hook finds the loss in it
        # and re-gathers the resharded weight before the backward writes its gradient
        out = lm_head_policy_loss(
            got.lm_head,
            hidden,
            labels,
            head=got.head,
            temperature=got.temperature,
            logit_scale=got.logit_scale,
            softcap=got.softcap,
            old_log_probs=old,
            advantages=packed("advantages"),
            cu_seqlens=offsets.to(hidden.device),
            in_call=False,
            **kwargs,
        )
        return tuple(getattr(out, name) for name in names)

    owner = weight_owner(got.root, got.lm_head)
    out = PolicyLossOutput(**dict(zip(names, in_module_call(owner, body), strict=True)))
    # the engine reads these back (0 at rows outside the responses); training discards them
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(out.log_probs[0], offsets)
    if calc_entropy:
        model_output["entropy"] = torch.nested.nested_tensor_from_jagged(out.entropy[0], offsets)
    summed = (
        dp_size > 1
        or num_tokens is not None
        or batch_size is not None
        or option(config, "loss_scale_factor") is not None
    )
    aggregation = AggregationType.SUM if summed else AggregationType.MEAN
    pg: dict[str, Any] = {
        "actor/pg_clipfrac": out.clip_fraction,
        "actor/ppo_kl": out.approx_kl,
        "actor/pg_clipfrac_lower": out.clip_fraction_lower,
    }
    metrics: dict[str, Any] = Metric.from_dict(pg, aggregation=AggregationType.MEAN)
    metrics["actor/pg_loss"] = Metric(value=out.pg_loss, aggregation=aggregation)
    if calc_entropy:
        metrics["actor/entropy_loss"] = Metric(value=out.entropy_loss, aggregation=aggregation)
    if out.kl is not None:
        metrics["kl_loss"] = Metric(value=out.kl, aggregation=aggregation)
        metrics["kl_coef"] = kwargs["kl_coef"]
    return out.loss, metrics


def fusedhead_policy_loss(
    old_log_prob: Any,
    log_prob: Any,
    advantages: Any,
    response_mask: Any,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """What ``register_policy_loss("fusedhead")`` registers: verl's vanilla loss on log-probs
    where no gradient is taken; a training step here means the fused path was not reached."""
    import torch
    from verl.trainer.ppo import core_algos

    vanilla: Any = core_algos.compute_policy_loss_vanilla  # its registry decorator hides the args

    if torch.is_grad_enabled() and getattr(log_prob, "requires_grad", False):
        raise RuntimeError(
            "policy_loss.loss_mode='fusedhead' is computed inside verl's FSDP engine "
            "(actor strategy fsdp/fsdp2, use_remove_padding, use_fused_kernels, impl_backend "
            "fusedhead:<name>); this training step called verl's policy loss with log-probs "
            "instead (another engine, or the patch is off: "
            "fusedhead.integrations.verl.enable_fused_policy_loss())"
        )
    result: tuple[Any, dict[str, Any]] = vanilla(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )
    return result


def register_loss_mode(module: types.ModuleType) -> None:
    """Register ``fusedhead`` in verl's policy-loss registry (``core_algos``)."""
    registry = module.POLICY_LOSS_REGISTRY
    if _enabled and registry.get(LOSS_MODE) is not fusedhead_policy_loss:
        module.register_policy_loss(LOSS_MODE)(fusedhead_policy_loss)


def wrap_forward_step(module: types.ModuleType) -> None:
    """Wrap ``FSDPEngineWithLMHead.forward_step`` and ``FSDPEngine.initialize`` (idempotent)."""
    if not _enabled:
        return
    for cls, name, wrap in (
        (module.FSDPEngineWithLMHead, "forward_step", _wrap_forward_step),
        (module.FSDPEngine, "initialize", _wrap_initialize),
    ):
        current = cls.__dict__[name]
        if not hasattr(current, "__fusedhead_original__"):
            setattr(cls, name, wrap(current))


def disarm() -> None:
    """Undo :func:`register_loss_mode`, :func:`wrap_forward_step` and
    :func:`track_actor_configs` where verl is imported."""
    engine = sys.modules.get(FSDP_ENGINE_MODULE)
    if engine is not None:
        for cls, name in (
            (engine.FSDPEngineWithLMHead, "forward_step"),
            (engine.FSDPEngine, "initialize"),
        ):
            original = getattr(cls.__dict__[name], "__fusedhead_original__", None)
            if original is not None:
                setattr(cls, name, original)
    actor = sys.modules.get(ACTOR_CONFIG_MODULE)
    if actor is not None:
        original = getattr(
            actor.ActorConfig.__dict__["__post_init__"], "__fusedhead_original__", None
        )
        if original is not None:
            actor.ActorConfig.__post_init__ = original
    _FUSED_CONFIGS.clear()
    core = sys.modules.get(CORE_ALGOS_MODULE)
    if core is not None and core.POLICY_LOSS_REGISTRY.get(LOSS_MODE) is fusedhead_policy_loss:
        del core.POLICY_LOSS_REGISTRY[LOSS_MODE]
