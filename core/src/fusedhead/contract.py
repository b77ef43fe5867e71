"""The contract between the core and a backend, written once: the capability gate a call passes
before the backend runs, and the checks of what it returns.

The gate refuses, by name, what a backend does not declare (per-token temperature, its
``min_temperature``, softcap, outputs, top-k width, vocab-parallel) for a head call and a KL call
alike. The output contract checks a ``HeadOutput`` (log-probs, entropy and the extras: ``lse``,
``sum_p2``, ``argmax``, ``topk``, ``gather``) or a ``KLOutput``: type, dtype, shape, device,
gradient, and on an eager call recording gradients that the autograd graph reaches hidden and
weight. ``FusedHeadOutput`` is the caller's result, in the labels' shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn

import torch

from fusedhead.checks import number_shown
from fusedhead.errors import BackendContractError, CapabilityError, type_name
from fusedhead.protocol import (
    OUTPUT_FIELDS,
    SCALAR_RANGE,
    Capabilities,
    HeadCall,
    HeadOutput,
    KLCall,
    KLOutput,
)
from fusedhead.value_checks import Pending

#: A backend's identity as errors carry it: ``backend``, ``distribution``, ``version``.
Identity = Mapping[str, Any]

#: Fields of ``HeadOutput`` past (log_probs, entropy), in the order ``FusedHeadOutput`` lists them.
EXTRA_FIELDS: tuple[str, ...] = (
    "lse",
    "sum_p2",
    "argmax",
    "topk_ids",
    "topk_log_probs",
    "gathered",
)
#: Fields that are integer ids, never differentiable.
_ID_FIELDS = frozenset({"argmax", "topk_ids"})
#: The outputs every backend computes; a call asking for no more takes the short path.
BASIC_OUTPUTS = frozenset({"log_probs", "entropy"})
#: Autograd nodes ``graph_breach`` visits at most before it gives up looking (and passes).
_MAX_NODES = 100_000

# Module constants for the per-call path (a global read, not a global and an attribute).
_Tensor = torch.Tensor
_F32 = torch.float32


class _LogProbsEntropy(NamedTuple):
    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class FusedHeadOutput(_LogProbsEntropy):
    """Per-token fp32 log-probabilities of the labels and entropies (None when not asked for).

    Unpacks as ``(log_probs, entropy)``; the further outputs (``top_k=``, ``gather_ids=`` and the
    ``return_*`` flags but ``return_entropy``) are attributes, None unless asked for:
    ``lse``, ``sum_p2``, ``argmax`` (labels' shape), ``topk_ids``, ``topk_log_probs`` (``[..., k]``)
    and ``gathered`` (``[..., K]``). See docs/distillation.md.
    """

    # Class-level None: an output built without extras (the common case) sets no attribute.
    lse: torch.Tensor | None = None
    sum_p2: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None
    gathered: torch.Tensor | None = None

    def __new__(
        cls,
        log_probs: torch.Tensor,
        entropy: torch.Tensor | None,
        *,
        lse: torch.Tensor | None = None,
        sum_p2: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_log_probs: torch.Tensor | None = None,
        gathered: torch.Tensor | None = None,
    ) -> FusedHeadOutput:
        self = super().__new__(cls, log_probs, entropy)
        if lse is not None or sum_p2 is not None or argmax is not None:
            self.lse, self.sum_p2, self.argmax = lse, sum_p2, argmax
        if topk_ids is not None or topk_log_probs is not None or gathered is not None:
            self.topk_ids, self.topk_log_probs, self.gathered = topk_ids, topk_log_probs, gathered
        return self


# --- the capability gate ---------------------------------------------------------------------


def _raise_below_min_temperature(
    arg: str,
    temp: float | torch.Tensor,
    floor: float,
    identity: Identity,
    scored: torch.Tensor | None = None,
) -> NoReturn:
    """The backend's ``min_temperature`` refusal, naming ``arg`` and the first value below it
    (of a per-token tensor, on a ``scored`` row)."""
    if isinstance(temp, torch.Tensor):
        low = (temp < floor) & scored if scored is not None else temp < floor
        idx = int(low.nonzero()[0, 0])
        got = (
            f"a per-token {arg} of {float(temp[idx]):g} (as fp32) at flat position {idx} "
            f"({int(low.sum())} value(s) below it)"
        )
    else:
        got = f"{arg}={number_shown(temp)!r}"
    raise CapabilityError(
        f"computes at temperatures >= {floor:g} (it declares min_temperature={floor:g}), got {got}",
        capability="min_temperature",
        hint="raise the temperature"
        + (
            ""
            if identity.get("backend") == "torch"
            else ", or name a backend with a smaller min_temperature, e.g. 'torch' (2**-100)"
        ),
        **identity,
    )


@torch.library.custom_op("fusedhead::check_min_temperature", mutates_args=())
def _min_temperature_checked(
    t: torch.Tensor,
    scored: torch.Tensor,
    floor: float,
    arg: str,
    backend: str,
    distribution: str,
    version: str,
) -> torch.Tensor:
    """The ``min_temperature`` check of a per-token tensor's scored rows in a compiled graph (as
    the validation's value checks: the eager check as an opaque op); a copy of ``t``."""
    if bool(((t < floor) & scored).any()):
        who = {"backend": backend, "distribution": distribution, "version": version}
        identity = {k: v or None for k, v in who.items()}
        _raise_below_min_temperature(arg, t, floor, identity, scored)
    return t.clone()


@_min_temperature_checked.register_fake
def _(t: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(t)


def _gate_temperature(
    arg: str,
    temp: float | torch.Tensor,
    caps: Capabilities,
    identity: Identity,
    pending: Pending | None,
    traced: bool,
    scored: torch.Tensor | None,
) -> float | torch.Tensor:
    """``temp`` as the backend takes it: a per-token tensor only where declared, at least its
    ``min_temperature`` (a float now; a tensor's ``scored`` rows in ``pending``'s one read, or,
    ``traced``, as an op of the graph whose checked copy is returned; no read otherwise:
    ``check_labels=False``). An ignored row may hold anything, so the backend gets its value
    raised to the floor there: it never sees a temperature below the one it declares."""
    # Not the class alone: under torch.compile a float that changed between calls is symbolic,
    # whose __class__ is SymFloat (a per-token refusal of a float, good values included).
    is_tensor = temp.__class__ is not float and isinstance(temp, torch.Tensor)
    if is_tensor and not caps.per_token_temperature:
        raise CapabilityError(
            f"does not support a per-token {arg} tensor",
            capability="per_token_temperature",
            hint="pass a float, or name a backend that declares per_token_temperature, e.g. 'torch'",
            **identity,
        )
    floor = caps.min_temperature
    if floor <= SCALAR_RANGE[0]:
        return temp  # the core's own range, already checked
    if isinstance(temp, torch.Tensor):
        if scored is None:  # every row scored
            scored = torch.ones(temp.shape, dtype=torch.bool, device=temp.device)
        if pending is not None:
            low = ((temp < floor) & scored).any()
            pending.add(low, _raise_below_min_temperature, arg, temp, floor, identity, scored)
        t = temp
        if traced and pending is None:
            who = [str(identity.get(k) or "") for k in ("backend", "distribution", "version")]
            t = _min_temperature_checked(t, scored, floor, arg, *who)
        return torch.where(scored, t, t.clamp_min(floor))
    if temp < floor:
        _raise_below_min_temperature(arg, temp, floor, identity)
    return temp


def _gate_softcap(arg: str, cap: float | None, caps: Capabilities, identity: Identity) -> None:
    if cap is not None and not caps.softcap:
        raise CapabilityError(
            f"does not support {arg}",
            capability="softcap",
            hint=f"drop {arg}, or name a backend that declares softcap, e.g. 'torch'",
            **identity,
        )


def gate_head(
    call: HeadCall,
    caps: Capabilities,
    identity: Identity,
    pending: Pending | None = None,
    traced: bool = False,
) -> HeadCall:
    """Refuse what ``caps`` does not declare for a head call, by name; the call to go on with
    (a traced per-token temperature passes through the graph's ``min_temperature`` check)."""
    temp = call.temperature
    scored = call.labels != call.ignore_index if isinstance(temp, torch.Tensor) else None
    temp = _gate_temperature("temperature", temp, caps, identity, pending, traced, scored)
    if temp is not call.temperature:
        call = call._replace(temperature=temp)
    _gate_softcap("softcap", call.softcap, caps, identity)
    missing = call.outputs.difference(caps.outputs)
    if missing:
        raise CapabilityError(
            f"does not compute the requested outputs {sorted(missing)} (it declares "
            f"{list(caps.outputs)})",
            capability=sorted(missing)[0],
            hint="drop them from the call, or name a backend that declares them",
            **identity,
        )
    if call.top_k and call.top_k > caps.max_top_k:
        raise CapabilityError(
            f"takes top_k up to {caps.max_top_k}, got top_k={call.top_k}",
            capability="max_top_k",
            hint="ask for fewer ids, or name a backend with a larger max_top_k",
            **identity,
        )
    if call.process_group is not None:
        _gate_vocab_parallel(call, caps, identity)
    return call


def _gate_vocab_parallel(call: HeadCall, caps: Capabilities, identity: Identity) -> None:
    """A ``process_group`` call: vocab-parallel declared, its outputs, and its shard layout."""
    if not caps.vocab_parallel:
        raise CapabilityError(
            "does not support process_group",
            capability="vocab_parallel",
            hint="name a backend that declares vocab_parallel, e.g. 'torch' or 'triton'",
            **identity,
        )
    missing = sorted(call.outputs.difference(caps.vocab_parallel_outputs))
    if missing:
        raise CapabilityError(
            f"does not compute {missing} under process_group (vocab-parallel it computes "
            f"{list(caps.vocab_parallel_outputs)})",
            capability="vocab_parallel_outputs",
            hint="drop them from the call, run without process_group, or name a backend that "
            "declares them in vocab_parallel_outputs",
            **identity,
        )
    if not caps.uneven_shards:
        import torch.distributed as dist

        v = call.weight.shape[0]
        rank, world = dist.get_rank(call.process_group), dist.get_world_size(call.process_group)
        if (call.vocab_start, call.vocab_size) != (rank * v, world * v):
            raise CapabilityError(
                f"needs equal contiguous vocabulary shards; got vocab_start={call.vocab_start}, "
                f"vocab_size={call.vocab_size} for {v} local rows on rank {rank} of {world}",
                capability="uneven_shards",
                hint="shard the vocabulary evenly, or name a backend that declares uneven_shards",
                **identity,
            )


def gate_kl(
    call: KLCall,
    caps: Capabilities,
    identity: Identity,
    pending: Pending | None = None,
    traced: bool = False,
) -> KLCall:
    """``gate_head`` for a two-head KL call: its direction, both temperatures, both softcaps."""
    if call.direction not in caps.kl_directions:
        raise CapabilityError(
            f"does not compute the {call.direction} KL of two heads (it declares "
            f"kl_directions={list(caps.kl_directions)})",
            capability="kl_directions",
            hint="name a backend that declares it, e.g. 'torch'",
            **identity,
        )
    temp = call.temperature
    scored = call.valid
    temp = _gate_temperature("temperature", temp, caps, identity, pending, traced, scored)
    if temp is not call.temperature:
        call = dataclasses.replace(call, temperature=temp)
    temp = call.teacher_temperature
    checked = _gate_temperature(
        "teacher_temperature", temp, caps, identity, pending, traced, scored
    )
    if checked is not temp:
        call = dataclasses.replace(call, teacher_temperature=checked)
    for arg in ("softcap", "teacher_softcap"):
        _gate_softcap(arg, getattr(call, arg), caps, identity)
    return call


def gate_policy_loss(caps: Capabilities, identity: Identity) -> None:
    """The policy loss runs only where ``policy_loss`` is declared: never another way."""
    if not caps.policy_loss:
        raise CapabilityError(
            "does not compute the policy loss in its forward (it does not declare policy_loss); "
            "fusedhead never runs it another way for you",
            capability="policy_loss",
            hint="name a backend that declares it, e.g. 'torch' or 'triton', or compute the loss "
            "from fused_head's log-probs",
            **identity,
        )


# --- the output contract ---------------------------------------------------------------------


def broke(reason: str, identity: Identity) -> NoReturn:
    """A backend's breach of the plugin contract, named."""
    raise BackendContractError(
        f"broke the plugin contract: {reason}",
        hint="report this to the backend's authors (an author: `fusedhead check NAME` runs the "
        "conformance kit, one line per property)",
        **identity,
    )


def describe(value: object) -> str:
    """``value`` as an error message shows what a backend returned."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, tuple):
        return f"a {len(value)}-tuple"
    return f"{type_name(value)} {value!r}"[:120]


def _width(call: HeadCall, field: str) -> int | None:
    """The last dimension of a field (``k`` or ``K``), or None for an ``[N]`` field."""
    if field in ("topk_ids", "topk_log_probs"):
        return call.top_k
    if field == "gathered":
        assert call.gather_ids is not None
        return int(call.gather_ids.shape[1])
    return None


def _unreached(node: Any, inputs: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of ``inputs`` (each requiring grad) that the graph from ``node`` never reaches: a
    non-leaf input by its ``grad_fn``, a leaf by the ``AccumulateGrad`` node holding it."""
    targets = {name: t.grad_fn for name, t in inputs.items() if t.requires_grad}
    missing = set(targets)
    # Nodes by id, each kept alive: a node's Python wrapper made by next_functions dies with its
    # last reference, and a later wrapper (another node) may get its id: taken for seen, its
    # subgraph was skipped and a reachable input reported unreached (seen on torch 2.11).
    seen: dict[int, Any] = {}
    stack = [node]
    while stack and missing and len(seen) < _MAX_NODES:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)
        for name in list(missing):
            target = targets[name]
            if (fn is target) if target is not None else (var is inputs[name]):
                missing.discard(name)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    if len(seen) >= _MAX_NODES:
        return []  # too large a graph to tell: no verdict
    return sorted(missing)


def graph_breach(what: str, t: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> str | None:
    """Why the differentiable output ``t`` cannot carry a gradient back to ``inputs`` (those
    requiring grad), or None: no graph at all (``grad_fn`` None, whatever ``requires_grad``
    says: ``torch.zeros(n, requires_grad=True)``, ``.detach().requires_grad_()``), or a graph
    that never reaches one of them. Not under Dynamo's tracing, which cannot read ``grad_fn``."""
    fn = t.grad_fn
    if fn is None:
        flag = "requires_grad is True but " if t.requires_grad else ""
        return (
            f"{what} is not attached to hidden or weight ({flag}grad_fn is None: a tensor the "
            "backend made or detached, not one computed from them), so no gradient would reach "
            "the model"
        )
    missing = _unreached(fn, inputs)
    if missing:
        return (
            f"{what}'s autograd graph does not reach {' or '.join(missing)}, which "
            f"{'requires' if len(missing) == 1 else 'require'} grad: the backend detached it "
            "from them, so no gradient would reach the model"
        )
    return None


def _check_tensor(
    what: str,
    t: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    needs_grad: bool,
    graph: bool,
    inputs: Mapping[str, torch.Tensor] | None,
    identity: Identity,
) -> None:
    """One returned tensor: its type, dtype, shape and device; if differentiable (``needs_grad``)
    that it requires grad; with ``graph`` that it has a ``grad_fn``, and with ``inputs`` too that
    its graph reaches them (``graph_breach``)."""
    kind = f"{str(dtype).removeprefix('torch.')} {list(shape)}"
    want = f"{kind} on {device}"
    if not isinstance(t, torch.Tensor):
        broke(f"{what} must be a {kind} tensor, got {describe(t)}", identity)
    if t.dtype != dtype or tuple(t.shape) != shape or t.device != device:
        broke(f"{what} must be {want}, got {t.dtype} {tuple(t.shape)} on {t.device}", identity)
    if needs_grad and not t.requires_grad:
        broke(
            f"{what} does not require grad although hidden or weight does: the backend "
            "detached it, so no gradient would reach the model",
            identity,
        )
    if needs_grad and graph and (inputs is not None or t.grad_fn is None):
        breach = graph_breach(what, t, inputs or {})
        if breach is not None:
            broke(breach, identity)


def check_output(
    call: HeadCall, out: object, graph: bool, identity: Identity, walk: bool = True
) -> bool:
    """A backend's head output against the contract, the authority (any breach is a
    ``BackendContractError``): every requested field set with its dtype, shape, device and
    gradient, every other one None. ``graph`` (an eager call recording gradients): each
    differentiable output has a ``grad_fn``, and with ``walk`` its autograd graph reaches hidden
    and weight; True when it was walked."""
    if not isinstance(out, HeadOutput):
        broke(
            f"forward() must return a fusedhead.protocol.HeadOutput, got {describe(out)}", identity
        )
    h, w = call.hidden, call.weight
    n = call.labels.shape[0]
    device = h.device
    needs_grad = (h.requires_grad or w.requires_grad) and torch.is_grad_enabled()
    graph = graph and needs_grad
    inputs = {"hidden": h, "weight": w} if graph and walk else None
    for what in ("log_probs", "entropy") if "entropy" in call.outputs else ("log_probs",):
        t = getattr(out, what)
        _check_tensor(what, t, (n,), _F32, device, needs_grad, graph, inputs, identity)
    if "entropy" not in call.outputs and out.entropy is not None:
        broke("entropy was not requested and must be None", identity)
    wanted = {f for o in call.outputs for f in OUTPUT_FIELDS.get(o, ())}
    for field in EXTRA_FIELDS:
        t = getattr(out, field, None)
        if field not in wanted:
            if t is not None:
                broke(f"{field} was not requested and must be None", identity)
            continue
        width = _width(call, field)
        shape = (n,) if width is None else (n, width)
        ids = field in _ID_FIELDS
        dtype = torch.int64 if ids else _F32
        if not isinstance(t, torch.Tensor):
            want = f"{str(dtype).removeprefix('torch.')} {list(shape)} on {device}"
            broke(
                f"{field} was requested and must be a {want} tensor, got {type(t).__name__}",
                identity,
            )
        _check_tensor(
            field, t, shape, dtype, device, needs_grad and not ids, graph, inputs, identity
        )
    return inputs is not None


def output_ok(
    call: HeadCall,
    out: object,
    n: int,
    device: torch.device,
    needs_grad: bool,
    graph: bool,
    basic: bool,
) -> bool:
    """The output contract as one expression over each tensor's properties read once, for the
    per-call path: True when ``out`` surely keeps it; any doubt goes to ``check_output``."""
    if out.__class__ is not HeadOutput:
        return False
    lp, ent = out.log_probs, out.entropy  # type: ignore[attr-defined]
    rows = (n,)
    if not (
        lp.__class__ is _Tensor
        and lp.dtype is _F32
        and lp.shape == rows
        and lp.device == device
        and (not needs_grad or lp.requires_grad)
        and (not graph or lp.grad_fn is not None)
    ):
        return False
    if "entropy" in call.outputs:
        if not (
            ent.__class__ is _Tensor
            and ent.dtype is _F32
            and ent.shape == rows
            and ent.device == device
            and (not needs_grad or ent.requires_grad)
            and (not graph or ent.grad_fn is not None)
        ):
            return False
    elif ent is not None:
        return False
    if basic:
        return (
            out.lse is None  # type: ignore[attr-defined]
            and out.sum_p2 is None  # type: ignore[attr-defined]
            and out.argmax is None  # type: ignore[attr-defined]
            and out.topk_ids is None  # type: ignore[attr-defined]
            and out.topk_log_probs is None  # type: ignore[attr-defined]
            and out.gathered is None  # type: ignore[attr-defined]
        )
    return False  # extras: check_output reads them (and is the authority)


def check_kl(out: object, call: KLCall, needs_grad: bool, graph: bool, identity: Identity) -> None:
    """A backend's ``kl()`` result: a ``KLOutput`` holding a float32 ``[N]`` tensor on the device,
    differentiable in the student; ``graph`` (eager, gradients recorded): its graph reaches them."""
    if not isinstance(out, KLOutput):
        broke(f"kl() must return a fusedhead.protocol.KLOutput, got {type(out).__name__}", identity)
    inputs = {"hidden": call.hidden, "weight": call.weight} if graph else None
    n = call.valid.shape[0]
    _check_tensor("kl", out.kl, (n,), _F32, call.hidden.device, needs_grad, graph, inputs, identity)


def shaped(out: torch.Tensor, shape: tuple[int, ...], tail: int | None = None) -> torch.Tensor:
    """``out`` in the labels' shape (plus its last dimension), never as a view (FSDP2 and
    in-place ops mishandle view outputs)."""
    full = shape if tail is None else (*shape, tail)
    if tuple(out.shape) == full:
        return out
    return out.reshape(full).clone()


def shaped_output(call: HeadCall, out: HeadOutput, shape: tuple[int, ...]) -> FusedHeadOutput:
    """A checked output with extras as the caller gets it, every field in the labels' shape."""
    extras: dict[str, Any] = {}
    for field in EXTRA_FIELDS:
        t = getattr(out, field)
        extras[field] = None if t is None else shaped(t, shape, _width(call, field))
    ent = out.entropy
    return FusedHeadOutput(
        shaped(out.log_probs, shape), None if ent is None else shaped(ent, shape), **extras
    )


def empty_output(call: HeadCall, shape: tuple[int, ...]) -> FusedHeadOutput:
    """N = 0: empty fp32 outputs that still belong to the autograd graph (zero gradients), the
    requested extras as empty tensors (float ones attached like the log-probs)."""
    zero = shaped(call.hidden.sum(-1).float() * 0 + call.weight.sum().float() * 0, shape)
    wanted = {f for o in call.outputs for f in OUTPUT_FIELDS.get(o, ())}
    extras: dict[str, Any] = {}
    for field in EXTRA_FIELDS:
        if field not in wanted:
            extras[field] = None
            continue
        width = _width(call, field)
        full = shape if width is None else (*shape, width)
        if field in _ID_FIELDS:
            extras[field] = torch.empty(full, dtype=torch.int64, device=zero.device)
        else:
            base = zero.reshape(*shape, *(() if width is None else (1,)))
            extras[field] = base.expand(full).clone()
    return FusedHeadOutput(zero, zero.clone() if call.return_entropy else None, **extras)
