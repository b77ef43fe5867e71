"""One call as the caller asked it: the request object every public entry point builds once.

``fused_head``, ``FusedHead.__call__``, ``FusedLMHead.forward`` and ``lm_head_logprobs`` build a
``HeadRequest``; ``fused_kl`` and ``FusedHead.kl`` a ``KLRequest``; ``fused_policy_loss`` and
``FusedHead.policy_loss`` a ``PolicyRequest``. A request holds the arguments as given, with the
head's configured defaults already resolved (``head_request`` does that for ``FusedHead.__call__``,
``FusedHead.request`` with the same ``CONFIGURED`` names); the head checks it
and makes the backend's call (``HeadCall``, ``KLCall``, ``PolicyLossCall``) from it once. Each is
an immutable NamedTuple: cheap to build on every step, and Dynamo traces it as plain values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar

import torch

from fusedhead.graph import tracing
from fusedhead.keywords import refuse


class HeadRequest(NamedTuple):
    """A head call: log-probs of ``labels`` and entropy of ``hidden @ weight.T / temperature``,
    plus the further outputs asked for (docs/design.md states each argument's contract)."""

    hidden: Any
    weight: Any
    labels: Any
    temperature: float | torch.Tensor = 1.0
    ignore_index: int = -100
    return_entropy: bool = True
    process_group: Any = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    reduce_hidden_grad: bool = True
    check_labels: bool = True
    softcap: float | None = None
    top_k: int | None = None
    gather_ids: torch.Tensor | None = None
    return_lse: bool = False
    return_sum_p2: bool = False
    return_argmax: bool = False


#: The fields of a ``HeadRequest`` that a head's configuration defaults (None: take the config's).
CONFIGURED = ("temperature", "ignore_index", "return_entropy", "check_labels", "softcap")
_HEAD_FIELDS = HeadRequest._fields
#: The output flags, by the naming rule: a field ``return_<output>`` asks for ``<output>`` of
#: ``HeadCall.outputs`` (``return_entropy`` aside: the entropy is a basic output). They close the
#: request, so ``req[FIRST_FLAG:]`` is the flags as given; a new flag is a field here, nothing else.
OUTPUT_FLAGS: tuple[tuple[str, str], ...] = tuple(
    (name, name.removeprefix("return_"))
    for name in _HEAD_FIELDS
    if name.startswith("return_") and name != "return_entropy"
)
FIRST_FLAG = len(_HEAD_FIELDS) - len(OUTPUT_FLAGS)
if _HEAD_FIELDS[FIRST_FLAG:] != tuple(name for name, _ in OUTPUT_FLAGS):  # pragma: no cover
    raise ImportError(f"HeadRequest's output flags must be its last fields, got {_HEAD_FIELDS}")
_CONFIGURED_AT = tuple((_HEAD_FIELDS.index(name), name) for name in CONFIGURED)
#: The fields' values out of a mapping, in order, in one C call (the per-step path; Dynamo
#: cannot trace an itemgetter, so a traced call reads them one by one).
_head_values = itemgetter(*_HEAD_FIELDS)
_new_tuple = tuple.__new__


def head_request(scope: Mapping[str, Any], config: Any = None) -> HeadRequest:
    """The ``HeadRequest`` of a public entry point from its ``locals()``: each field read by its
    own name, so an entry point spells its options only in its signature. With ``config``, a
    configured field left None takes the config's value (``FusedHead`` and ``FusedLMHead``)."""
    if tracing():
        values: Any = [scope[name] for name in _HEAD_FIELDS]
    elif config is None:  # fused_head: the arguments as given
        return _new_tuple(HeadRequest, _head_values(scope))  # type: ignore[no-any-return]
    else:
        values = list(_head_values(scope))
    if config is not None:
        for i, name in _CONFIGURED_AT:
            if values[i] is None:
                values[i] = getattr(config, name)
    return _new_tuple(HeadRequest, values)  # type: ignore[no-any-return]


F = TypeVar("F", bound=Callable[..., Any])


def entry_point(
    request: type[tuple[Any, ...]],
    run: Callable[..., Any],
    foreign: Mapping[str, str] | None = None,
) -> Callable[[F], F]:
    """The per-step form of a public entry point whose body is ``run(request(locals()), **rest)``.

    The decorated function is the contract and the readable body; the function returned has its
    very signature, defaults and docstring, and builds the request from its parameters in one
    tuple, with no ``locals()`` dict (about 0.6 us of a ~4 us call): generated code, as
    ``dataclasses`` and ``namedtuple`` make their ``__init__``, so each option is still spelled
    only in the signature and the request. Parameters that are not fields of ``request``
    (``backend``, ``options``) go to ``run`` by name; every field must be a parameter. An
    unknown keyword gets ``keywords.refuse``'s did-you-mean (``foreign``: other trainers' names).
    """

    def make(fn: F) -> F:
        params = list(inspect.signature(fn).parameters.values())
        names = [p.name for p in params]
        fields = request._fields  # type: ignore[attr-defined]
        if missing := [f for f in fields if f not in names]:
            raise TypeError(f"{fn.__qualname__} lacks {request.__name__} fields {missing}")
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
        if len(positional) + len(keyword) != len(params):
            raise TypeError(f"{fn.__qualname__}: only plain and keyword-only parameters")
        rest = ", ".join(f"{n}={n}" for n in names if n not in fields)
        head = ", ".join(positional + (["*", *keyword] if keyword else []) + ["**_unknown"])
        source = (
            f"def {fn.__name__}({head}):\n"
            "    if _unknown:\n"
            "        _refuse(_where, sorted(_unknown), _own, _foreign)\n"
            f"    return _run(_new(_request, ({', '.join(fields)},)), {rest})\n"
        )
        scope: dict[str, Any] = {
            "_run": run,
            "_new": tuple.__new__,
            "_request": request,
            "_refuse": refuse,
            "_where": fn.__qualname__,
            "_own": sorted(keyword),
            "_foreign": foreign or {},
        }
        exec(compile(source, f"<entry point {fn.__qualname__}>", "exec"), scope)
        out = scope[fn.__name__]
        out.__defaults__, out.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        for attr in ("__doc__", "__qualname__", "__module__", "__annotations__"):
            setattr(out, attr, getattr(fn, attr))
        out.__wrapped__ = fn  # inspect.signature and getsource show the decorated function
        return out  # type: ignore[no-any-return]

    return make


def output_flags(scope: Mapping[str, Any]) -> dict[str, Any]:
    """The output flags (``OUTPUT_FLAGS``) that ``scope``, an entry point's ``locals()``, holds
    and sets to anything but False, by name: what it passes on to a head call as given."""
    return {name: scope[name] for name, _ in OUTPUT_FLAGS if scope.get(name, False) is not False}


class KLRequest(NamedTuple):
    """A two-head KL call (``fused_kl``): the student (``hidden``, ``weight``) and the teacher."""

    hidden: Any
    weight: Any
    teacher_hidden: Any
    teacher_weight: Any
    labels: Any = None
    direction: str = "forward"
    temperature: float | torch.Tensor = 1.0
    teacher_temperature: float | torch.Tensor = 1.0
    ignore_index: int = -100
    softcap: float | None = None
    teacher_softcap: float | None = None
    check_labels: bool = True


class PolicyRequest(NamedTuple):
    """A policy-loss call (``fused_policy_loss``): the head's arguments and the loss's."""

    hidden: Any
    weight: Any
    labels: Any
    old_log_probs: Any
    advantages: Any
    temperature: float | torch.Tensor = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    ref_log_probs: torch.Tensor | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    rollout_log_probs: torch.Tensor | None = None
    tis_cap: float | None = None
    aggregation: str = "token-mean"
    loss_normalizer: float | torch.Tensor | None = None
    horizon: float | None = None
    cu_seqlens: torch.Tensor | None = None
    ignore_index: int = -100
    softcap: float | None = None
    check_labels: bool = True
