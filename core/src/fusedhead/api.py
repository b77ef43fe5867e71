"""The public calls: ``fused_head``, ``fused_kl``, ``fused_policy_loss``, and the process-wide
cache of resolved heads (``get_fused_head``, ``cached_head``) they and the integrations share.

Each call builds its request (``fusedhead.request``) once and hands it to the cached
``FusedHead`` (``fusedhead.head``), which checks, gates, runs and checks the backend's answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel

from fusedhead import registry
from fusedhead.config import FusedHeadConfig
from fusedhead.contract import FusedHeadOutput
from fusedhead.graph import Slots, as_graph_constant, slot_numbers
from fusedhead.graph import tracing as _tracing
from fusedhead.head import HEAD_FOREIGN_KEYWORDS, FusedHead
from fusedhead.keywords import known_keywords
from fusedhead.options import cache_text
from fusedhead.policy_args import FOREIGN_KEYWORDS
from fusedhead.policy_output import PolicyLossOutput
from fusedhead.request import HeadRequest, KLRequest, PolicyRequest, entry_point, head_request

__all__ = [
    "FusedHead",
    "FusedHeadOutput",
    "cached_head",
    "fused_head",
    "fused_kl",
    "fused_policy_loss",
    "get_fused_head",
]


def _backend_name(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(backend).__name__} {backend!r}"
        )
    return backend


#: Resolved heads by (backend, options key), and by ("mapping" | "config", text, None) for
#: ``cached_head`` (three items: never equal to a backend's key, whatever the backend's name).
_cache: dict[tuple[Any, ...], FusedHead] = {}
#: The same heads by their validated settings (``_head_for``): one head per settings.
_by_settings: dict[str, FusedHead] = {}
_lock = threading.RLock()  # cached_head resolves a mapping through the config path

#: Option values a key holds as themselves (class included: 1, 1.0 and True are three keys, as
#: their JSON texts are); anything else (nested lists and mappings, ...) goes through JSON.
_FLAT = (str, int, float, bool, type(None))


def _flat_key(options: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...] | None:
    """``options`` as sorted (name, class name, value) items when every value is a flat JSON
    scalar (NaN excepted: it equals nothing), else None."""
    for k in options:
        if k.__class__ is not str:
            return None
    items = []
    for k in sorted(options):  # names, not items: Dynamo sorts constants only
        v = options[k]
        if v.__class__ not in _FLAT or v != v:
            return None
        items.append((k, v.__class__.__name__, v))
    return tuple(items)


def _options_key(options: Any) -> tuple[tuple[str, str, Any], ...] | str:
    """The cache key of a backend's options: flat ones as a tuple, the rest as their
    ``cache_text`` (sorted JSON where every key is a str)."""
    if options is None:
        return ()
    if isinstance(options, BaseModel):
        options = options.model_dump(mode="json")
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, got {type(options).__name__}")
    key = _flat_key(options)
    if key is not None:
        return key
    return cache_text(options)  # never raises: validation names a key that is not a str


def get_fused_head(backend: str, options: Mapping[str, Any] | BaseModel | None = None) -> FusedHead:
    """The process-wide ``FusedHead`` for (backend, options); resolved, and observed, once.

    Under ``torch.compile`` the head is looked up (or resolved) while tracing and is a constant
    of the graph: the first call may be compiled too, with ``fullgraph=True``.
    """
    if _tracing():
        return _traced_head(backend, options)
    key = (backend, _options_key(options))
    head = _cache.get(key)
    if head is None:
        with _lock:
            head = _cache.get(key)
            if head is None:
                opts = (
                    options.model_dump() if isinstance(options, BaseModel) else dict(options or {})
                )
                head = _head_for(FusedHeadConfig.from_arguments(backend=backend, options=opts))
                _cache[key] = head
    return head


def _head_for(config: FusedHeadConfig) -> FusedHead:
    """The one head of ``config``'s settings (under ``_lock``): configs whose validated options
    are equal (a default spelled out or left out, a NumPy int for an int, a backend's Options
    model) share it, so the provenance hook fires once for them."""
    from fusedhead import registry

    # The options as they are now (a dict changed in place since validation is validated again)
    resolved = registry.resolve(config.backend, config.options, config.resolved)
    fields = {**config.to_dict(), "options": resolved.options.model_dump(mode="json")}
    key = json.dumps(fields, sort_keys=True, default=repr)
    head = _by_settings.get(key)
    if head is None:
        head = FusedHead(config)
        _by_settings[key] = head
    return head


#: The cache's heads as compiled graphs read them (``graph.Slots``), and their names by key.
_graph = Slots()
_graph_names: dict[tuple[Any, ...], str] = {}


def _traced_head(backend: str, options: Mapping[str, Any] | BaseModel | None) -> FusedHead:
    """``get_fused_head`` as Dynamo sees it: a call it runs eagerly (resolving the head if need
    be: that does not trace) names the slot of the head, which the graph reads and guards."""
    flat = _flat_key(options) if isinstance(options, Mapping) else None
    # Flat options as the key the trace built (Dynamo hands its own values over more reliably
    # than a mapping it was given), the rest as given.
    name = (
        _key_in_trace(backend, None, flat)
        if flat is not None
        else _key_in_trace(backend, options, None)
    )
    head: FusedHead = getattr(_graph, name)
    return head


def _slot(key: tuple[Any, ...], head: FusedHead) -> str:
    """The name of ``head``'s slot in ``_graph`` (made on the first call for ``key``)."""
    name = _graph_names.get(key)
    if name is None:
        name = _graph_names[key] = f"head{next(slot_numbers)}"
        setattr(_graph, name, head)
    return name


@as_graph_constant
def _key_in_trace(backend: str, options: Any, flat: tuple[tuple[str, str, Any], ...] | None) -> str:
    """Run by Dynamo while it traces, never traced (the graph guards on its arguments' values):
    the head for (backend, options), resolved into the cache, and the name of its slot;
    ``flat``: the options as ``_flat_key`` gave them (then ``options`` is None)."""
    if flat is not None:
        options = {k: v for k, _, v in flat}
    head = get_fused_head(backend, options)
    return _slot((backend, _options_key(options)), head)


def cached_head(config: FusedHeadConfig | Mapping[str, Any] | FusedHead | None) -> FusedHead:
    """The process-wide ``FusedHead`` for a whole configuration (integrations call this per step).

    A mapping is looked up by its own text first, so a step pays no config validation. Under
    ``torch.compile`` the head is resolved while tracing (see ``get_fused_head``).
    """
    if isinstance(config, FusedHead):
        return config
    if _tracing():
        traced: FusedHead = getattr(_graph, _config_key_in_trace(config))
        return traced
    key = _config_key(config)
    head = _cache.get(key)
    if head is None:
        with _lock:
            head = _cache.get(key)
            if head is None:
                if isinstance(config, FusedHeadConfig):
                    head = _head_for(config)
                else:  # a mapping: validated into a config, which has its own entry
                    head = cached_head(FusedHeadConfig.from_dict(dict(config or {})))
                _cache[key] = head
    return head


def _config_key(config: object) -> tuple[str, str, None]:
    """``cached_head``'s key: a mapping by its own text, a ``FusedHeadConfig`` by its dict's."""
    if config is None or isinstance(config, Mapping):
        raw = {} if config is None else dict(config)
        return ("mapping", cache_text(raw), None)
    if not isinstance(config, FusedHeadConfig):
        raise TypeError(
            "config must be a FusedHeadConfig, a mapping, a FusedHead or None, "
            f"got {type(config).__name__}"
        )
    return ("config", json.dumps(config.to_dict(), sort_keys=True, default=repr), None)


@as_graph_constant
def _config_key_in_trace(config: Any) -> str:
    """``cached_head``'s part that Dynamo runs while it traces (see ``_key_in_trace``)."""
    head = cached_head(config)
    return _slot(_config_key(config), head)


def _forget() -> None:
    """``refresh()``: every resolved head dropped; a graph that read one retraces on its next call."""
    with _lock:
        _cache.clear()
        _by_settings.clear()
        _graph_names.clear()
        vars(_graph).clear()


registry.on_refresh(_forget)


def _run_fused_head(
    req: HeadRequest, backend: str, options: Mapping[str, Any] | BaseModel | None
) -> FusedHeadOutput:
    """``fused_head`` once its request is built: the named backend's cached head runs it."""
    try:
        if backend.__class__ is not str:
            _backend_name(backend)
        if req.temperature is None:
            raise TypeError("temperature must be a float or a tensor, got None")
        # Without options the head's key is known: the cache's own entry, without building it.
        head = (
            None if options is not None or _tracing() else _cache.get((backend, ()))
        ) or get_fused_head(backend, options)
    except Exception:
        if req.process_group is not None and req.check_labels is not False and not _tracing():
            from fusedhead import rank_agreement  # the other ranks wait in its gather: told

            rank_agreement.refused(req.process_group, req.hidden)
        raise
    return head.run(req)


@entry_point(HeadRequest, _run_fused_head, HEAD_FOREIGN_KEYWORDS)
def fused_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    backend: str = "torch",
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    options: Mapping[str, Any] | BaseModel | None = None,
    process_group: Any = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    check_labels: bool = True,
    softcap: float | None = None,
    top_k: int | None = None,
    gather_ids: torch.Tensor | None = None,
    return_lse: bool = False,
    return_sum_p2: bool = False,
    return_argmax: bool = False,
) -> FusedHeadOutput:
    """Log-prob of each label and entropy of each row of ``hidden @ weight.T / temperature``.

    ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]``; outputs fp32 of the labels' shape.
    Further outputs on request: ``top_k`` ids and log-probs, log-probs at ``gather_ids [..., K]``,
    the log-sum-exp, the sum of squared probabilities, the argmax (docs/distillation.md).
    The backend is the one named, always; docs/design.md states the full contract.
    """
    # What runs is this body without the locals() dict (request.entry_point generates it).
    return _run_fused_head(head_request(locals()), backend, options)


@known_keywords({})
def fused_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    direction: str = "forward",
    backend: str = "torch",
    temperature: float | torch.Tensor = 1.0,
    teacher_temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    options: Mapping[str, Any] | BaseModel | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Per-token KL between a student head (``hidden``, ``weight``) and a teacher head, fp32.

    ``direction="forward"``: ``KL(p_teacher || p_student)``; ``"reverse"``: ``KL(p_student ||
    p_teacher)``. Each head has its own temperature and softcap (``c * tanh(z / c)`` before the
    temperature, as in ``fused_head``); the heads share V, their H may differ.
    Rows whose label is ``ignore_index`` give 0 (``labels=None``: every row counts). Gradients
    reach the student only; no ``[N, V]`` tensor is formed. ``check_labels=False`` reads no
    per-token temperature's values (CUDA-graph capture), as in ``fused_head``.
    See docs/distillation.md.
    """
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(backend).__name__} {backend!r}"
        )
    if temperature is None:  # FusedHead.kl reads None as its config's: here it is a mistake
        raise TypeError("temperature must be a float or a tensor, got None")
    return get_fused_head(_backend_name(backend), options).run_kl(
        KLRequest(
            hidden,
            weight,
            teacher_hidden,
            teacher_weight,
            labels,
            direction=direction,
            temperature=temperature,
            teacher_temperature=teacher_temperature,
            ignore_index=ignore_index,
            softcap=softcap,
            teacher_softcap=teacher_softcap,
            check_labels=check_labels,
        )
    )


@known_keywords(FOREIGN_KEYWORDS)
def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    backend: str = "torch",
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
    loss_normalizer: float | torch.Tensor | None = None,
    horizon: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    options: Mapping[str, Any] | BaseModel | None = None,
) -> PolicyLossOutput:
    """The PPO/GRPO policy loss of ``hidden @ weight.T / temperature``, its gradients computed in
    the forward: three GEMMs per token chunk, no ``[N, V]`` tensor (docs/policy-loss.md).

    verl's semantics: ratio ``exp(lp - old_log_probs)`` (``None``: on-policy, the ratio 1 with
    slope 1 that ``lp - lp.detach()`` gives, no GEMM for old log-probs), clipped surrogate
    (``clip_low``, ``clip_high``, ``dual_clip`` for negative advantages), truncated importance
    sampling (``rollout_log_probs``, ``tis_cap``), ``- entropy_coef`` times the entropy,
    ``+ kl_coef`` times the ``kl_estimator`` KL to ``ref_log_probs``, each aggregated by
    ``aggregation`` (verl's ``loss_agg_mode``; ``cu_seqlens`` for a packed batch,
    ``loss_normalizer`` for the global count over the data-parallel size, ``horizon`` for the length
    ``seq-mean-token-sum-norm`` divides by: verl's ``loss_scale_factor``).
    Rows whose label is ``ignore_index`` add nothing. ``hidden [..., H]``, ``weight [V, H]`` and
    ``labels [...]`` as for ``fused_head``, with its ``softcap``; ``backend`` is the name of the
    one that runs (it must declare ``policy_loss``), ``options`` its options. Defaults: clip
    0.2 / 0.2, no dual clip, no entropy or KL term, k3, token-mean. Returns a
    ``PolicyLossOutput``: ``loss`` (differentiable in hidden and weight), detached per-token
    ``log_probs`` and ``entropy``, and the metrics trainers log (``out.metrics()``).
    """
    if temperature is None:
        raise TypeError("temperature must be a float or a tensor, got None")
    return get_fused_head(_backend_name(backend), options).run_policy_loss(
        PolicyRequest(
            hidden,
            weight,
            labels,
            old_log_probs=old_log_probs,
            advantages=advantages,
            temperature=temperature,
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
            softcap=softcap,
        )
    )
