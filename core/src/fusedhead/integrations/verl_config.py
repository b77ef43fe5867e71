"""verl's actor config, as the fused policy loss takes it: ``actor_rollout_ref.actor`` mapped to
:func:`fusedhead.fused_policy_loss`'s keywords, and an actor or setup it cannot run refused by name.

Kept apart from :mod:`fusedhead.integrations.verl_actor` (the patches of verl that run the fused
loss) so that the mapping and its checks read and test on their own. Nothing here imports torch
or verl at import time.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "VERL_AGG_MODES",
    "VERL_KL_TYPES",
    "check_actor_config",
    "check_fused_setup",
    "loss_mode_of",
    "option",
    "policy_loss_kwargs",
    "verl_device",
]
#: The full names of the settings the fused loss needs, as verl's YAML spells them.
_MODEL = "actor_rollout_ref.model"
_LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"


def loss_mode_of(config: Any) -> Any:
    """An actor config's ``policy_loss.loss_mode`` (verl's default ``vanilla`` when unset)."""
    policy = option(config, "policy_loss")
    return "vanilla" if policy is None else option(policy, "loss_mode", "vanilla")


def option(config: Any, name: str, default: Any = None) -> Any:
    """``config[name]`` of a mapping-like config (OmegaConf, dict) or its attribute (a dataclass)."""
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(name, default)
    return getattr(config, name, default)


#: verl's ``kl_loss_type`` names, as fusedhead's estimator: every one but ``full`` (which needs
#: whole distributions); a ``+`` form is the value with k2's gradient (k2+ is k2 itself).
VERL_KL_TYPES = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
    **{f"{name}+": f"{est}+" for name, est in (("kl", "k1"), ("k1", "k1"), ("abs", "abs"))},
    **{f"{name}+": "k2" for name in ("mse", "k2")},
    **{f"{name}+": "k3+" for name in ("low_var_kl", "k3")},
}
#: verl's ``loss_agg_mode`` values, as fusedhead's aggregation (token-sum: a token mean whose
#: normaliser is 1 / dp_size; seq-mean-token-sum-norm: a sequence sum over sequences x horizon).
VERL_AGG_MODES = {
    "token-mean": "token-mean",
    "token-sum": "token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
}


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    getter = getattr(config, "get", None)
    if callable(getter):  # a DictConfig or a dict
        return getter(name, default)
    return getattr(config, name, default)


def _real(name: str, value: Any, *, low: float, high: float = math.inf, what: str) -> float:
    """``value`` of verl's option ``name`` as the float its fused_policy_loss argument takes,
    checked with the core's own check (``fusedhead.checks.real_in``) under verl's name."""
    from fusedhead.checks import real_in

    return real_in(name, value, low=low, high=high, what=what)


def _dual_clip(value: Any) -> float:
    what = "a finite float > 1 (verl's dual-clip bound)"
    out = _real("clip_ratio_c", value, low=1.0, what=what)
    if out == 1.0:
        raise ValueError(f"clip_ratio_c must be {what}, got {value!r}")
    return out


def agg_mode(actor_config: Any) -> str:
    """The actor config's ``loss_agg_mode``, one of verl's, else a ``ValueError`` listing them
    with a did-you-mean (verl's own check names neither)."""
    from fusedhead.checks import did_you_mean  # torch, not at import time

    agg = _cfg(actor_config, "loss_agg_mode", "token-mean")
    if agg not in VERL_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={agg!r} is not one of verl's {list(VERL_AGG_MODES)}"
            f"{did_you_mean(agg, VERL_AGG_MODES)}"
        )
    return str(agg)


def policy_loss_kwargs(
    actor_config: Any,
    *,
    horizon: int | None = None,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
) -> dict[str, Any]:
    """``fused_policy_loss``'s keywords from verl's actor config (``actor_rollout_ref.actor``).

    Maps ``loss_agg_mode``, ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high``,
    ``clip_ratio_c`` (verl's dual clip, always on), ``entropy_coeff``, ``use_kl_loss`` /
    ``kl_loss_coef`` / ``kl_loss_type``, and verl's global batch info (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) into the loss normaliser,
    as verl's ``agg_loss`` divides. ``horizon``: the padded response length verl's
    ``seq-mean-token-sum-norm`` divides by when ``loss_scale_factor`` is unset. What fusedhead
    does not compute (``policy_loss.loss_mode`` other than ``vanilla``, ``kl_loss_type``
    ``full``) is a ``ValueError`` naming the setting.
    """
    from fusedhead.checks import check_clip_low, did_you_mean  # torch, not at import time

    policy = _cfg(actor_config, "policy_loss", None)
    mode = _cfg(policy, "loss_mode", "vanilla") if policy is not None else "vanilla"
    if mode not in ("vanilla", "fusedhead"):  # fusedhead: vanilla, computed by the fused loss
        what = "sequence-level ratios (GSPO)" if mode == "gspo" else "another loss"
        raise ValueError(
            f"policy_loss.loss_mode={mode!r} is {what}; fusedhead's fused policy loss is verl's "
            "'vanilla' (compute_policy_loss_vanilla): use it, or verl's own loss with "
            "impl_backend fusedhead:<name> for the log-probs"
        )
    agg = agg_mode(actor_config)
    clip = _cfg(actor_config, "clip_ratio", 0.2)
    low = _cfg(actor_config, "clip_ratio_low", None)
    high = _cfg(actor_config, "clip_ratio_high", None)
    # each value checked as fused_policy_loss checks its argument, under verl's name for it
    kwargs: dict[str, Any] = dict(
        clip_low=check_clip_low(
            "clip_ratio" if low is None else "clip_ratio_low", clip if low is None else low
        ),
        clip_high=_real(
            "clip_ratio" if high is None else "clip_ratio_high",
            clip if high is None else high,
            low=0.0,
            what="a finite float >= 0",
        ),
        dual_clip=_dual_clip(_cfg(actor_config, "clip_ratio_c", 3.0)),
        entropy_coef=_real(
            "entropy_coeff",
            _cfg(actor_config, "entropy_coeff", 0.0),
            low=-math.inf,
            what="a finite float",
        ),
        aggregation=VERL_AGG_MODES[agg],
    )
    if _cfg(actor_config, "use_kl_loss", False):
        kl_type = _cfg(actor_config, "kl_loss_type", "low_var_kl")
        if kl_type not in VERL_KL_TYPES:
            full = isinstance(kl_type, str) and kl_type.rstrip("+") == "full"
            why = (
                ": 'full' needs whole distributions, which a fused head never holds (nor does "
                "verl 0.9.1 compute it: its kl_penalty raises NotImplementedError for 'full')"
                if full
                else did_you_mean(kl_type, VERL_KL_TYPES)
            )
            raise ValueError(
                f"kl_loss_type={kl_type!r} is not computed by fusedhead's fused loss; use one of "
                f"{sorted(VERL_KL_TYPES)}{why}"
            )
        coef = _cfg(actor_config, "kl_loss_coef", 0.001)
        kwargs.update(
            kl_coef=_real("kl_loss_coef", coef, low=0.0, what="a finite float >= 0"),
            kl_estimator=VERL_KL_TYPES[kl_type],
        )
    scale = _cfg(actor_config, "loss_scale_factor", None)
    if scale is not None:
        from fusedhead.checks import COUNT_FLOOR, COUNT_TEXT  # torch, not at import time

        what = (
            f"a length > 0 (the sequence length seq-mean-token-sum-norm divides by), {COUNT_TEXT}"
        )
        scale = _real("loss_scale_factor", scale, low=COUNT_FLOOR, what=what)
    normalizer: Any = None
    if agg == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError(
                "batch_num_tokens (verl's global token count) is needed when dp_size > 1"
            )
        normalizer = None if batch_num_tokens is None else _count(batch_num_tokens) / dp_size
    elif agg == "token-sum":
        normalizer = 1.0 / dp_size
    else:
        if global_batch_size is None and dp_size > 1:
            raise ValueError("global_batch_size is needed when dp_size > 1")
        normalizer = None if global_batch_size is None else _count(global_batch_size) / dp_size
        if agg == "seq-mean-token-sum-norm":
            factor = scale if scale is not None else horizon
            if factor is None:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor in the config "
                    "or horizon (the padded response length verl divides by)"
                )
            if normalizer is None:  # one rank: verl counts the micro-batch's own sequences
                kwargs.update(aggregation="seq-mean-token-sum-norm", horizon=float(factor))
            else:
                normalizer = normalizer * factor
    kwargs["loss_normalizer"] = normalizer
    return kwargs


def rollout_is_kwargs(old_log_probs: Any, weights: Any, labels: Any = None) -> dict[str, Any]:
    """verl's rollout importance-sampling weights ``w`` (already truncated, or zero where IcePop
    masks) as ``fused_policy_loss``'s ``rollout_log_probs = old - log w`` and a ``tis_cap`` no
    weight reaches: each token's weight is then ``w``, with no gradient through it, except that
    the loss clamps ``log w`` to +-20 (``tis_log_ratio``, verl's own bound on the log-ratio) so a
    weight outside ``[e^-20, e^20]`` (only after ``rollout_is_batch_normalize``) is taken at that
    bound; 0 stays 0.

    A weight that is NaN, negative or infinite on a scored token (``labels`` not -100) is refused
    under verl's name, in the one host read the cap takes."""
    import torch

    if labels is not None and tuple(weights.shape) != tuple(labels.shape):
        raise ValueError(
            f"rollout_is_weights must have the labels' shape {tuple(labels.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    scored = weights if labels is None else weights.masked_fill(labels == -100, 1.0)
    low, high = torch.stack(torch.aminmax(scored)).tolist() if scored.numel() else (1.0, 1.0)
    if not 0.0 <= low <= high < math.inf:  # a NaN fails too
        bad = ~(scored.isfinite() & (scored >= 0))
        at = int(bad.flatten().nonzero()[0])
        raise ValueError(
            "rollout_is_weights (verl's rollout correction weights) must be finite and >= 0 on "
            f"scored tokens (label != -100), got {scored.flatten()[at].item()} at flat position "
            f"{at} ({int(bad.sum())} such value(s))"
        )
    return {"rollout_log_probs": old_log_probs - weights.log(), "tis_cap": max(high, 1.0)}


def _count(value: Any) -> Any:
    """A global count verl divides by, at least 1: a batch with no scored token (rejection
    sampling masked them all) has loss 0 and zero gradients at any count, where verl's
    ``agg_loss`` divides by 0 (a NaN loss); an int, a float or a tensor (no host read)."""
    clamp = getattr(value, "clamp", None)
    return clamp(min=1) if callable(clamp) else max(value, 1)


def check_actor_config(config: Any) -> None:
    """Refuse, by name, an actor config whose settings the fused loss does not compute."""
    if option(config, "use_prefix_grouper", False):
        raise ValueError(
            "policy_loss.loss_mode='fusedhead' with use_prefix_grouper=True: the prefix grouper "
            "changes the model's forward; use loss_mode 'vanilla' with it"
        )
    # the mapping itself (loss_agg_mode, clip ratios, KL type); batch sizes come per micro-batch
    policy_loss_kwargs(config, horizon=1, global_batch_size=1)


def check_fused_setup(config: Any, model_config: Any, engine_config: Any = None) -> None:
    """Refuse, by the settings' names, an actor with ``loss_mode: fusedhead`` that cannot run it.

    ``config``: ``actor_rollout_ref.actor``; ``model_config``: ``actor_rollout_ref.model``
    (verl's ``HFModelConfig``); ``engine_config``: the actor's engine config, for Ulysses.
    Called when verl's FSDP engine for that model is built (before the model is loaded) and at
    its first forward, whatever the pass, so that a setting the fused loss cannot run with is
    named before a forward-only pass (the old log-probs) runs into it. Each is a ``ValueError``
    naming the setting, its value and the fix (for ``impl_backend``, the installed backends that
    compute the loss, and the closest of them to a misspelt ``fusedhead:`` name).
    """
    from fusedhead.checks import did_you_mean
    from fusedhead.integrations.backend_spec import installed_backend_names, is_fusedhead_spec

    check_actor_config(config)
    for key in ("use_remove_padding", "use_fused_kernels"):
        if not option(model_config, key, False):
            raise ValueError(
                f"{_LOSS_MODE}='fusedhead' needs {_MODEL}.{key}: true (got {key}="
                f"{option(model_config, key, False)!r}); set it, or loss_mode 'vanilla' for verl's "
                "own loss"
            )
    options = option(model_config, "fused_kernel_options", None) or {}
    backend = option(options, "impl_backend", None)
    if not is_fusedhead_spec(backend):
        if backend is None:
            what = "unset (verl's own fused kernel)"
        elif backend in ("torch", "triton", "liger"):
            what = f"{backend!r}, verl's own fused kernel, whose forward returns log-probs"
        else:
            what = f"{backend!r}, not a fusedhead backend"
        loss_backends = [f"fusedhead:{n}" for n in _policy_loss_backends(installed_backend_names())]
        ours = ", ".join(repr(n) for n in loss_backends) or "none installed"
        raise ValueError(
            f"{_LOSS_MODE}='fusedhead' computes the loss from the hidden states fusedhead's model "
            f"forward hands over, but {_MODEL}.fused_kernel_options.impl_backend is {what}: "
            f"set impl_backend: fusedhead:<name> (installed ones that compute the loss: "
            f"{ours}), or loss_mode 'vanilla' for verl's own loss"
            f"{did_you_mean(backend, loss_backends)}"
        )
    _check_loss_capability(backend)
    sp = option(engine_config, "ulysses_sequence_parallel_size", 1) if engine_config else 1
    if isinstance(sp, int) and sp > 1:
        raise ValueError(
            f"{_LOSS_MODE}='fusedhead' with ulysses_sequence_parallel_size={sp}: each rank holds a "
            "slice of the packed sequence; use loss_mode 'vanilla' with sequence parallelism"
        )


def verl_device() -> str:
    """The device type verl's workers compute on: ``verl.utils.device.get_device_name``, except
    that verl 0.9.1 names ``cuda`` also where CUDA is absent (its default), which is the CPU."""
    import torch
    from verl.utils.device import get_device_name

    name = str(get_device_name())
    return "cpu" if name == "cuda" and not torch.cuda.is_available() else name


def _check_loss_capability(backend: str) -> None:
    """``impl_backend``'s backend must declare ``policy_loss`` on verl's device: refused here,
    when the engine is built, not at the first training micro-batch after the rollout."""
    from fusedhead.integrations.backend_spec import (
        installed_backend_names,
        lacks_policy_loss,
        resolve_lm_head,
    )

    setting = f"{_MODEL}.fused_kernel_options.impl_backend"
    head = resolve_lm_head(backend, setting=setting)
    device = verl_device()
    if head.capabilities(device).policy_loss:
        return
    loss_backends = [f"fusedhead:{n}" for n in _policy_loss_backends(installed_backend_names())]
    ours = ", ".join(repr(n) for n in loss_backends) or "none installed"
    raise lacks_policy_loss(
        head,
        f"{_LOSS_MODE}='fusedhead' computes the loss inside the head, but {setting}="
        f"{backend!r} names a backend that does not declare policy_loss on {device}",
        f"set impl_backend to one that does (installed: {ours}), or loss_mode 'vanilla' for "
        "verl's own loss on this backend's log-probs",
    )


def _policy_loss_backends(names: list[str]) -> list[str]:
    """Those of ``names`` whose backend declares ``policy_loss`` (on the CPU: the declaration
    does not depend on the device for any backend shipped here); one that fails to load is left
    out. Loads the backends: an error path only."""
    from fusedhead.api import get_fused_head

    found = []
    for name in names:
        try:
            if get_fused_head(name).capabilities("cpu").policy_loss:
                found.append(name)
        except Exception:  # a broken plugin is named by its own error elsewhere
            continue
    return found
