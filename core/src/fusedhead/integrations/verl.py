"""verl (tested with 0.9.1): ``fused_kernel_options.impl_backend: fusedhead:<name>``.

verl picks its fused LM head by name in ``verl.models.transformers.monkey_patch.
patch_forward_with_backends``, against a hard-coded list (``torch``, ``triton``, ``liger``), and
only *prints* "Skipping monkey patch" for any other name. It has no registry for the head; what
it has is the ``verl.plugins`` entry-point group, loaded by ``import verl``. fusedhead's entry
point there (``fusedhead.integrations._verl_plugin``) calls :func:`install`, which replaces that
one public function, as soon as verl imports its module, with :func:`patch_forward_with_backends`:

- ``impl_backend: fusedhead:<name>`` (or ``fusedhead`` for the default backend) with
  ``use_fused_kernels: true``: the model's forward becomes :func:`forward_with_fusedhead_backend`,
  which scores verl's rolled labels (``shift_labels`` = the engine's ``input_ids_rmpad_rolled``)
  through :func:`fusedhead.integrations.lm_head.lm_head_logprobs`. The LM-head weight is read
  inside ``lm_head``'s own call, so it also works when FSDP2 shards an untied ``lm_head`` on its
  own (``apply_fsdp2`` does), where verl's own fused path reads a DTensor (verl #5633);
- every other value goes to verl's own function, unchanged (installing fusedhead changes nothing
  for a config that does not name it), except a value that looks meant for fusedhead (a misspelt
  ``fusedhaed:triton``), which raises ``ValueError`` instead of verl's silent skip, as does a
  fusedhead name with fused kernels off.

The same entry point arms :mod:`fusedhead.integrations.veomni` when verl imports VeOmni, so
verl's VeOmni engine takes ``cross_entropy_loss_implementation: fusedhead:<name>`` from verl's
config as well.

The backend is resolved (``FusedHead``) when the model is patched, so an unknown name fails at
model build with the installed names listed, and the ``fusedhead_backend_resolved`` hook reports
provenance then. Nothing here imports verl or torch at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

from fusedhead.integrations import verl_actor
from fusedhead.integrations.verl_config import (
    VERL_AGG_MODES,
    VERL_KL_TYPES,
    policy_loss_kwargs,
    rollout_is_kwargs,
    verl_device,
)
from fusedhead.keywords import known_keywords

__all__ = [
    "MONKEY_PATCH_MODULE",
    "VERL_AGG_MODES",
    "VERL_BACKENDS",
    "VERL_KL_TYPES",
    "enable_fused_policy_loss",
    "fix_trl_value_head_probe",
    "forward_with_fusedhead_backend",
    "fused_policy_loss_enabled",
    "fused_ppo_loss",
    "install",
    "is_installed",
    "patch_forward_with_backends",
    "policy_loss_kwargs",
    "trl_has_value_head",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: The verl module whose ``patch_forward_with_backends`` picks the fused head by name.
MONKEY_PATCH_MODULE = "verl.models.transformers.monkey_patch"

#: ``impl_backend`` values verl 0.9.1 handles itself (``patch_forward_with_backends``).
VERL_BACKENDS: tuple[str, ...] = ("torch", "triton", "liger")

#: Model types for which verl swaps in its own multimodal forward; fusedhead's forward is the
#: text-only one (``self.model`` then ``self.lm_head``), so these are refused, not mis-scored.
VERL_MULTIMODAL_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5", "qwen3_5_moe"}
)

#: VeOmni's loss-mapping module, used by verl's VeOmni engine; armed too (see :func:`install`).
VEOMNI_CROSS_ENTROPY_MODULE = "veomni.ops.kernels.cross_entropy"

_lock = threading.RLock()
_original: dict[str, Callable[..., Any]] = {}
_finder: _PatchOnImport | None = None
_armed_veomni = False
#: Whether :func:`fix_trl_value_head_probe` is on (applied to verl's module when it is imported).
_trl_probe_fixed = False
#: The verl modules the fused actor loss patches (fusedhead.integrations.verl_actor).
_ACTOR_MODULES = (
    "verl.trainer.ppo.core_algos",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.config.actor",
)
#: Where TRL keeps (kept) the value-head model verl 0.9.1's ``apply_monkey_patch`` patches.
TRL_VALUE_HEAD_MODULES = ("trl.experimental.ppo", "trl")


def install() -> None:
    """Make verl accept ``impl_backend: fusedhead:<name>``; idempotent, imports nothing heavy.

    If verl's ``monkey_patch`` module is already imported it is patched now; otherwise a
    ``sys.meta_path`` finder patches it right after verl imports it, so no one holds the
    original function. VeOmni's cross-entropy module is armed the same way
    (:func:`fusedhead.integrations.veomni.install`), so verl's VeOmni engine accepts
    ``cross_entropy_loss_implementation: fusedhead:<name>`` from verl's config too; VeOmni's
    own names are unaffected.
    """
    global _finder
    with _lock:
        for name, patch in _TARGETS.items():
            module = sys.modules.get(name)
            if module is not None:
                _apply(patch, module)
        if _finder is None and any(name not in sys.modules for name in _TARGETS):
            _finder = _PatchOnImport()
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Undo :func:`install`: verl's own ``patch_forward_with_backends`` again, finder removed.

    Model classes already patched keep their forward (verl patches classes the same way).
    """
    global _finder, _armed_veomni, _trl_probe_fixed
    with _lock:
        _trl_probe_fixed = False
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        module = sys.modules.get(MONKEY_PATCH_MODULE)
        original = _original.pop("patch_forward_with_backends", None)
        if module is not None and original is not None:
            module.patch_forward_with_backends = original  # type: ignore[attr-defined]
        _restore_trl_probe(module)
        if any(name in sys.modules for name in _ACTOR_MODULES):
            verl_actor.disarm()
        if _armed_veomni:
            from fusedhead.integrations import veomni

            veomni.uninstall()
            _armed_veomni = False


def is_installed() -> bool:
    """True when verl's ``patch_forward_with_backends`` is (or will be, on import) fusedhead's."""
    module = sys.modules.get(MONKEY_PATCH_MODULE)
    if module is None:
        return _finder is not None and _finder in sys.meta_path
    return getattr(module, "patch_forward_with_backends", None) is patch_forward_with_backends


def _patch_module(module: types.ModuleType) -> None:
    current = getattr(module, "patch_forward_with_backends", None)
    if current is None:
        raise RuntimeError(
            f"{MONKEY_PATCH_MODULE} has no patch_forward_with_backends: this verl is not one "
            "fusedhead's integration supports (tested with verl 0.9.1)"
        )
    if _trl_probe_fixed:
        _apply_trl_probe(module)
    if current is patch_forward_with_backends:
        return
    _original["patch_forward_with_backends"] = current
    module.patch_forward_with_backends = patch_forward_with_backends  # type: ignore[attr-defined]


def trl_has_value_head() -> bool:
    """verl's ``is_trl_available`` narrowed to what verl then imports: TRL's value-head model.

    True when TRL is installed and still has ``AutoModelForCausalLMWithValueHead`` (in
    ``trl.experimental.ppo`` or ``trl``); TRL 1.16 has neither, so there is nothing to patch.
    """
    import importlib
    import importlib.util
    import warnings

    if importlib.util.find_spec("trl") is None:
        return False
    for name in TRL_VALUE_HEAD_MODULES:
        try:
            with warnings.catch_warnings():  # TRL warns on any import from trl.experimental
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "AutoModelForCausalLMWithValueHead"):
            return True
    return False


def _apply_trl_probe(module: types.ModuleType) -> None:
    current = getattr(module, "is_trl_available", None)
    if current is None:
        raise RuntimeError(
            f"{MONKEY_PATCH_MODULE} has no is_trl_available: fix_trl_value_head_probe is for "
            "verl 0.9.1, whose apply_monkey_patch probes TRL through it"
        )
    if current is not trl_has_value_head:
        _original["is_trl_available"] = current
        module.is_trl_available = trl_has_value_head  # type: ignore[attr-defined]


def _restore_trl_probe(module: types.ModuleType | None) -> None:
    original = _original.pop("is_trl_available", None)
    if module is not None and original is not None:
        module.is_trl_available = original  # type: ignore[attr-defined]


def fix_trl_value_head_probe(enable: bool = True) -> None:
    """Opt-in: let verl 0.9.1's ``apply_monkey_patch`` run beside TRL >= 1.16 (``False`` undoes it).

    With TRL installed, verl's ``apply_monkey_patch`` imports TRL's
    ``AutoModelForCausalLMWithValueHead`` to patch its ``state_dict``; TRL 1.16 dropped that class,
    so the import raises ``ImportError`` and no model can be built. This replaces the one name
    verl's ``monkey_patch`` module probes with, ``is_trl_available``, by
    :func:`trl_has_value_head`: verl still patches the class wherever TRL has it, and skips the
    patch where there is no class to patch. verl's other modules are untouched (its value-head
    critic still needs a TRL that has the class). Applied now if verl's module is imported, else
    when verl imports it. Upstream fix that removes this: verl probing for the class itself
    (``try: from trl... import AutoModelForCausalLMWithValueHead except ImportError: skip``,
    docs/integrations/verl.md). In verl's Ray workers, set ``FUSEDHEAD_VERL_FIX_TRL_PROBE=1``:
    the ``verl.plugins`` entry point then calls this on ``import verl``.
    """
    global _trl_probe_fixed
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__} {enable!r}")
    with _lock:
        _trl_probe_fixed = enable
        module = sys.modules.get(MONKEY_PATCH_MODULE)
        if not enable:
            _restore_trl_probe(module)
            return
        if module is not None:
            _apply_trl_probe(module)
        else:
            install()


def _arm_veomni(module: types.ModuleType) -> None:
    global _armed_veomni
    from fusedhead.integrations import veomni

    if not veomni.is_installed():
        veomni.install()
        _armed_veomni = True


def _register_loss_mode(module: types.ModuleType) -> None:
    verl_actor.register_loss_mode(module)


def _wrap_forward_step(module: types.ModuleType) -> None:
    verl_actor.wrap_forward_step(module)


def _track_actor_configs(module: types.ModuleType) -> None:
    verl_actor.track_actor_configs(module)


_TARGETS: dict[str, Callable[[types.ModuleType], None]] = {
    MONKEY_PATCH_MODULE: _patch_module,
    VEOMNI_CROSS_ENTROPY_MODULE: _arm_veomni,
    # policy_loss.loss_mode: fusedhead (fusedhead.integrations.verl_actor)
    "verl.trainer.ppo.core_algos": _register_loss_mode,
    "verl.workers.engine.fsdp.transformer_impl": _wrap_forward_step,
    verl_actor.ACTOR_CONFIG_MODULE: _track_actor_configs,
}


def _apply(patch: Callable[[types.ModuleType], None], module: types.ModuleType) -> None:
    """Patch ``module``; a failure is logged loudly, never allowed to break the trainer's import."""
    try:
        patch(module)
    except Exception:
        logger.warning(
            "fusedhead: could not patch %s; fusedhead backend names will not work there "
            "(verl 0.9.1 and VeOmni 0.1.12 are the tested versions)",
            module.__name__,
            exc_info=True,
        )


class _PatchingLoader(importlib.abc.Loader):
    """Runs the trainer's module as its own loader would, then patches it."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            _apply(_TARGETS[module.__name__], module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tools
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and wraps their loaders."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _installed_names() -> list[str]:
    from fusedhead import diagnostics

    return sorted({row.name for row in diagnostics.listing()})


def _accepted_names() -> str:
    ours = ", ".join(f"'fusedhead:{n}'" for n in _installed_names()) or "none installed"
    theirs = ", ".join(f"'{n}'" for n in VERL_BACKENDS)
    return f"verl's own {theirs}; fusedhead's {ours}"


def patch_forward_with_backends(
    model: Any,
    use_fused_kernels: bool = False,
    fused_kernels_backend: str | None = None,
) -> None:
    """verl's ``patch_forward_with_backends`` with fusedhead's names added, the rest verl's.

    ``fused_kernels_backend`` is ``actor_rollout_ref.model.fused_kernel_options.impl_backend``.
    A ``fusedhead:<name>`` value patches the model's forward to fusedhead's; a misspelt
    fusedhead name with ``use_fused_kernels`` on raises ``ValueError``; everything else goes to
    verl's function as it is (verl's own names, and verl's own skip of names it does not know).
    """
    from fusedhead.integrations.backend_spec import is_fusedhead_spec, is_misspelt_spec

    if is_fusedhead_spec(fused_kernels_backend):
        assert isinstance(fused_kernels_backend, str)
        if not use_fused_kernels:
            raise ValueError(
                f"fused_kernel_options.impl_backend={fused_kernels_backend!r} has no effect with "
                "use_fused_kernels=False: set actor_rollout_ref.model.use_fused_kernels=True, or "
                "drop the fusedhead impl_backend"
            )
        _patch_model(model, fused_kernels_backend)
        return
    if use_fused_kernels and is_misspelt_spec(fused_kernels_backend, VERL_BACKENDS):
        raise ValueError(
            f"fused_kernel_options.impl_backend={fused_kernels_backend!r} is not a fused-kernel "
            f"backend (use_fused_kernels=True); accepted: {_accepted_names()}. verl itself would "
            "skip the patch silently and compute full logits"
        )
    original: Callable[..., Any] | None = _original.get("patch_forward_with_backends")
    if original is None:
        from verl.models.transformers import monkey_patch

        original = cast(Callable[..., Any], monkey_patch.patch_forward_with_backends)
        if original is patch_forward_with_backends:  # pragma: no cover - defensive
            raise RuntimeError("verl's own patch_forward_with_backends was lost")
    original(
        model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
    )


#: The setting that names verl's fused-kernel backend, as verl's config spells it.
IMPL_BACKEND = "actor_rollout_ref.model.fused_kernel_options.impl_backend"


def _patch_model(model: Any, spec: str) -> None:
    """Resolve the backend ``spec`` names and give ``model``'s class fusedhead's forward."""
    from torch import nn

    from fusedhead.integrations.backend_spec import check_head_runs_on, resolve_lm_head

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in VERL_MULTIMODAL_MODEL_TYPES:
        raise ValueError(
            f"impl_backend={spec!r}: model_type {model_type!r} uses verl's own multimodal forward, "
            "which fusedhead's verl integration does not replace (text-only causal LMs: a "
            "self.model decoder and a self.lm_head); use impl_backend 'torch' or 'triton' for it"
        )
    lm_head = getattr(model, "lm_head", None)
    decoder = getattr(model, "model", None)
    if not isinstance(lm_head, nn.Module) or not isinstance(decoder, nn.Module):
        raise TypeError(
            f"impl_backend={spec!r} needs a causal LM with a .model decoder and an .lm_head "
            f"module, got {type(model).__name__} (lm_head={type(lm_head).__name__}, "
            f"model={type(decoder).__name__})"
        )
    # a malformed spelling or an unknown name raises here, named as the user wrote it
    head = resolve_lm_head(spec, setting=IMPL_BACKEND)
    # fail at model build, not at the first batch: the backend must run on verl's device, in the
    # dtype verl's FSDP engine computes in when it is the engine building this model
    check_head_runs_on(
        head,
        verl_device(),
        verl_actor.building_dtype(),
        setting=IMPL_BACKEND,
        value=spec,
        options_via=None,
    )
    model._verl_fused_kernels_backend = spec
    model._fusedhead_head = head
    verl_actor.patched_model(model)
    type(model).forward = forward_with_fusedhead_backend
    logger.info(
        "fusedhead: %s uses backend %r for verl's fused log-probs/entropy (impl_backend=%r)",
        type(model).__name__,
        head.config.backend,
        spec,
    )


def forward_with_fusedhead_backend(
    self: Any,
    input_ids: Any = None,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    inputs_embeds: Any = None,
    labels: Any = None,
    use_cache: bool | None = None,
    output_attentions: bool | None = None,
    output_hidden_states: bool | None = None,
    return_dict: bool | None = None,
    cache_position: Any = None,
    logits_to_keep: Any = 0,
    temperature: Any = 1.0,
    shift_labels: Any = None,
    **loss_kwargs: Any,
) -> Any:
    """verl's fused-kernel forward contract (``CausalLMOutputForPPO``) computed by fusedhead.

    Same signature and label choice as verl's ``dense_common.forward_with_torch_backend``:
    ``shift_labels`` (the engine's globally rolled ``input_ids_rmpad_rolled``) verbatim, else
    ``labels`` rolled by one, else ``input_ids`` rolled by one. Labels equal to -100 give 0.
    ``log_probs`` and ``entropy`` are fp32 in the labels' shape, packed ``[1, total]`` or
    ``[B, T]``.
    """
    import torch
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model

    from fusedhead.integrations.lm_head import lm_head_logprobs
    from fusedhead.integrations.logit_transforms import model_logit_transform

    head = getattr(self, "_fusedhead_head", None)
    if head is None:
        raise RuntimeError(
            f"{type(self).__name__}.forward was patched by fusedhead for another instance; this "
            "one was not given a backend: build every model of this class through verl's "
            "apply_monkey_patch with the same impl_backend"
        )
    if not return_dict:
        raise ValueError(
            "forward_with_fusedhead_backend returns verl's CausalLMOutputForPPO: call it with "
            f"return_dict=True (verl's engine does), got return_dict={return_dict!r}"
        )
    outputs = forward_base_model(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        cache_position=cache_position,
    )
    hidden_states = outputs[0]
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError(
            "forward_with_fusedhead_backend needs shift_labels, labels or input_ids to score"
        )
    # The model's own logit scale and softcap (Cohere, Granite, Gemma-2), as its logits path
    # applies them: verl's own fused kernels drop them.
    scale, softcap = model_logit_transform(getattr(self, "config", None))
    if verl_actor.hand_over(
        hidden_states, self.lm_head, head, rolled, temperature, (scale, softcap)
    ):
        # policy_loss.loss_mode: fusedhead computes the loss from the hidden states; the engine's
        # read-out gets NaN stand-ins, which that loss replaces (nothing else reads them). The
        # hidden states are returned too: FSDP2 hooks the root's backward (re-gathering its
        # resharded parameters) on the outputs the loss's gradient reaches.
        stand_in = torch.full(rolled.shape, float("nan"), device=rolled.device)
        output_cls_: Any = CausalLMOutputForPPO
        return output_cls_(
            log_probs=stand_in,
            entropy=stand_in,
            past_key_values=outputs.past_key_values,
            hidden_states=(hidden_states,),
            attentions=outputs.attentions,
        )
    # verl scores every packed position (its rolled ids hold no ignore_index), so every row goes
    # to the backend as is: no host sync, no copy of the selected rows.
    out = lm_head_logprobs(
        self.lm_head,
        hidden_states,
        rolled.to(torch.int64),
        head=head,
        temperature=temperature,
        softcap=softcap,
        logit_scale=scale,
        select_rows=False,
    )
    output_cls: Any = CausalLMOutputForPPO
    return output_cls(
        log_probs=out.log_probs,
        entropy=out.entropy,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@known_keywords(
    {
        "loss_scale_factor": "read from actor_config, as verl reads it",
        "old_log_prob": "verl's data key; pass old_log_probs",
        "response_mask": "pass labels set to -100 where the mask is 0",
    }
)
def fused_ppo_loss(
    actor_config: Any,
    lm_head: Any,
    hidden: Any,
    labels: Any,
    *,
    old_log_probs: Any,
    advantages: Any,
    ref_log_prob: Any = None,
    cu_seqlens: Any = None,
    head: Any = None,
    temperature: Any = 1.0,
    rollout_is_weights: Any = None,
    horizon: int | None = None,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """verl's ``ppo_loss`` (vanilla policy loss, entropy bonus, KL loss) fused into the head.

    ``hidden [1, T, H]`` packed (``cu_seqlens``) or ``[B, T, H]``, ``labels`` verl's rolled ids
    with -100 outside the response mask, per-token tensors in the labels' shape. Returns
    ``(loss, metrics)`` with verl's metric names (``actor/pg_loss``, ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/entropy_loss``, ``kl_loss``,
    ``kl_coef``), values as detached tensors (no host sync). ``rollout_is_weights``: verl's
    rollout correction weights (``rollout_is: token``), in the labels' shape. ``horizon``,
    ``dp_size``, ``batch_num_tokens``, ``global_batch_size``: see :func:`policy_loss_kwargs`
    (``loss_scale_factor`` is read from ``actor_config``).
    """
    from fusedhead.integrations.lm_head import lm_head_policy_loss

    kwargs = policy_loss_kwargs(
        actor_config,
        horizon=horizon,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )
    if rollout_is_weights is not None:
        kwargs.update(rollout_is_kwargs(old_log_probs, rollout_is_weights, labels))
    if "kl_coef" in kwargs:
        if ref_log_prob is None:
            raise ValueError(
                "use_kl_loss=True needs ref_log_prob (the reference policy's log-probs)"
            )
        kwargs["ref_log_probs"] = ref_log_prob
    out = lm_head_policy_loss(
        lm_head,
        hidden,
        labels,
        head=head,
        temperature=temperature,
        old_log_probs=old_log_probs,
        advantages=advantages,
        cu_seqlens=cu_seqlens,
        **kwargs,
    )
    metrics: dict[str, Any] = {
        "actor/pg_loss": out.pg_loss,
        "actor/pg_clipfrac": out.clip_fraction,
        "actor/ppo_kl": out.approx_kl,
        "actor/pg_clipfrac_lower": out.clip_fraction_lower,
        "actor/entropy_loss": out.entropy_loss,
    }
    if out.kl is not None:
        metrics["kl_loss"] = out.kl
        metrics["kl_coef"] = kwargs["kl_coef"]
    return out.loss, metrics


def enable_fused_policy_loss(enable: bool = True) -> None:
    """Arm (``False``: disarm) ``policy_loss.loss_mode: fusedhead`` in verl 0.9.1.

    Registers the loss mode in verl's policy-loss registry and wraps the FSDP engine's
    ``forward_step`` (now if verl's modules are imported, else when verl imports them). Inert for
    every config that does not name ``fusedhead``. ``import verl`` calls this through fusedhead's
    ``verl.plugins`` entry point; call it yourself where plugins are off
    (docs/integrations/verl.md, "From verl's config").
    """
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__} {enable!r}")
    verl_actor.set_enabled(enable)
    if enable:
        install()  # applies the two patches now or on import (its module targets)


def fused_policy_loss_enabled() -> bool:
    """True when the FSDP engine's ``forward_step`` is fusedhead's wrapper (or will be on import)."""
    module = sys.modules.get(verl_actor.FSDP_ENGINE_MODULE)
    if module is None:
        return verl_actor.is_armed() and is_installed()
    return hasattr(module.FSDPEngineWithLMHead.__dict__["forward_step"], "__fusedhead_original__")
