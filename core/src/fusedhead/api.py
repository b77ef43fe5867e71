"""The contract: ``fused_head(...)`` and the ``FusedHead`` object that resolves its backend once."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple, NoReturn

import torch
from pydantic import BaseModel

from fusedhead import extras, policy, registry
from fusedhead.config import FusedHeadConfig, validate_options
from fusedhead.errors import (
    BackendContractError,
    BackendError,
    BackendUnavailableError,
    CapabilityError,
)
from fusedhead.hooks import plugin_manager
from fusedhead.protocol import SCALAR_RANGE, Capabilities, HeadCall, HeadOutput
from fusedhead.validation import (
    _DEVICES,
    Pending,
    _device_entry,
    dtype_name,
    usable_device,
    validate,
    validate_kl,
    with_outputs,
)


def _raise_below_min_temperature(
    arg: str, temp: float | torch.Tensor, floor: float, identity: Mapping[str, Any]
) -> NoReturn:
    """The backend's ``min_temperature`` refusal, naming ``arg`` and the (smallest) value."""
    if isinstance(temp, torch.Tensor):
        low = temp < floor
        idx = int(low.nonzero()[0, 0])
        got = (
            f"a per-token {arg} of {float(temp[idx]):g} (as fp32) at flat position {idx} "
            f"({int(low.sum())} value(s) below it)"
        )
    else:
        got = f"{arg}={temp!r}"
    raise CapabilityError(
        f"computes at temperatures >= {floor:g} (it declares min_temperature={floor:g}), got {got}",
        capability="min_temperature",
        hint="raise the temperature, or name a backend with a smaller min_temperature, e.g. 'torch'",
        **identity,
    )


@torch.library.custom_op("fusedhead::check_min_temperature", mutates_args=())
def _min_temperature_checked(
    t: torch.Tensor, floor: float, arg: str, backend: str, distribution: str, version: str
) -> torch.Tensor:
    """The ``min_temperature`` check of a per-token tensor in a compiled graph (as the
    validation's value checks: the eager check as an opaque op); a copy of ``t``."""
    if bool((t < floor).any()):
        who = {"backend": backend, "distribution": distribution, "version": version}
        _raise_below_min_temperature(arg, t, floor, {k: v or None for k, v in who.items()})
    return t.clone()


@_min_temperature_checked.register_fake
def _(t: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(t)


def _as_graph_constant(fn: Any) -> Any:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does, without importing Dynamo
    (1.2 s) with this module: Dynamo then runs it while tracing and keeps its result as a
    constant of the graph, which is how a head is resolved inside a compiled function."""
    fn._dynamo_marked_constant = True
    return fn


class _Slots:
    """What a compiled graph reads of a cache, one attribute per entry. Dynamo reads an
    attribute as it is at that moment, but a dict it has read once in a trace stays, for the
    rest of that trace, as it was then: entries made later in the trace would not be seen."""


_slot_numbers = itertools.count()  # slot names are never reused: a stale graph never matches


@_as_graph_constant
def _prime_device(device: torch.device) -> None:
    """Under ``torch.compile``, before ``validate`` reads its table of devices: the entry made
    eagerly (a table the trace found without it would be guarded so, and the next call retrace)."""
    if device not in _DEVICES:
        _device_entry(device)


class _LogProbsEntropy(NamedTuple):
    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class FusedHeadOutput(_LogProbsEntropy):
    """Per-token fp32 log-probabilities of the labels and entropies (None when not asked for).

    Unpacks as ``(log_probs, entropy)``; the further outputs (``top_k=``, ``gather_ids=``,
    ``return_lse=``, ``return_sum_p2=``, ``return_argmax=``) are attributes, None unless asked for:
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


class FusedHead:
    """A backend resolved once from a ``FusedHeadConfig``, then called per step."""

    def __init__(
        self, config: FusedHeadConfig | Mapping[str, Any] | None = None, **overrides: Any
    ) -> None:
        if config is None:  # keyword arguments: an error names the argument
            config = FusedHeadConfig._from_arguments(**overrides)
        elif isinstance(config, Mapping):
            config = FusedHeadConfig.from_dict({**config, **overrides})
        elif isinstance(config, FusedHeadConfig):
            if overrides:
                config = FusedHeadConfig.from_dict({**config.to_dict(), **overrides})
        else:
            raise TypeError(
                f"config must be a FusedHeadConfig or a mapping, got {type(config).__name__}"
            )
        self.config = config
        cand = registry.find(config.backend)
        cls = registry.load_class(config.backend)
        self.distribution = cand.distribution
        self.version = cand.version
        self.options = validate_options(config.backend, cls, config.options)
        self.backend = registry.construct_backend(cls, self.options, **self._identity())
        self._caps: dict[tuple[torch.device, torch.dtype], tuple[Capabilities, frozenset[str]]] = {}
        self._graph = _Slots()  # _caps's entries for compiled graphs (see _prepare)
        self._graph_names: dict[tuple[torch.device, torch.dtype], str] = {}
        # (device, dtype, outputs) whose outputs' autograd graphs were seen to reach hidden and
        # weight (extras.graph_breach, on the first eager call with gradients; later calls check
        # that each output has a grad_fn).
        self._attached: set[tuple[torch.device, torch.dtype, frozenset[str]]] = set()
        # A device this process cannot use is refused here, where it is first used (the config
        # itself only parses it: a config file travels between machines).
        device = usable_device(config.device) if config.device else registry.default_device()
        caps = self.capabilities(device)
        self._check_required(caps, device)
        plugin_manager().hook.fusedhead_backend_resolved(
            name=config.backend,
            distribution=cand.distribution,
            version=cand.version,
            options=self.options.model_dump(mode="json"),
            capabilities=caps.model_dump(mode="json"),
        )

    @property
    def name(self) -> str:
        return self.config.backend

    def __repr__(self) -> str:
        return f"FusedHead(backend={self.name!r}, distribution={self.distribution!r}, version={self.version!r})"

    def _identity(self) -> dict[str, str | None]:
        return {"backend": self.name, "distribution": self.distribution, "version": self.version}

    @contextmanager
    def _identified(self, what: str | None = None) -> Iterator[None]:
        """Errors from the backend carry its identity; with ``what``, other exceptions become
        ``BackendContractError`` (a backend method that must only raise ``BackendError``)."""
        try:
            yield
        except BackendError as exc:
            raise exc.attach(**self._identity()) from None
        except Exception as exc:
            if what is None:
                raise
            raise BackendContractError(
                f"{what} raised {type(exc).__name__}: {exc}",
                hint="a backend's check() must raise fusedhead.errors.BackendUnavailableError with "
                "the reason and the fix; report this to the backend's authors",
                **self._identity(),
            ) from exc

    def capabilities(self, device: torch.device | str) -> Capabilities:
        """The backend's capabilities on ``device`` (a plugin that breaks the contract there, by
        raising or by returning something else, is a ``BackendContractError`` naming it)."""
        caps: Capabilities = registry.backend_capabilities(
            self.backend, torch.device(device), **self._identity()
        )
        return caps

    def _check_required(self, caps: Capabilities, device: torch.device) -> None:
        missing = [c for c in self.config.require if not getattr(caps, c, False)]
        if missing:
            raise CapabilityError(
                f"does not declare the required capabilities {missing} on {device}",
                capability=missing[0],
                hint="fusedhead never picks another backend for you: choose one that declares "
                "them, or drop the requirement",
                **self._identity(),
            )

    def _ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities:
        """Capabilities on (device, dtype), after the backend's own check; cached per pair."""
        return (self._caps.get((device, dtype)) or self._ready_entry(device, dtype))[0]

    def _ready_entry(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[Capabilities, frozenset[str]]:
        """The first call on (device, dtype): the backend's check, then its capabilities there
        (and their outputs as a set), cached for every later call on the pair."""
        key = (device, dtype)
        entry = self._caps.get(key)
        if entry is None:
            with self._identified("check()"):
                self.backend.check(
                    device, dtype
                )  # first: its message carries the reason and the fix
            caps = self.capabilities(device)
            if device.type not in caps.devices:
                raise BackendUnavailableError(
                    f"does not run on device type {device.type!r} (it declares {list(caps.devices)})",
                    hint=f"move hidden and weight to one of {list(caps.devices)}, or name a backend "
                    f"that runs on {device.type!r}",
                    **self._identity(),
                )
            if dtype_name(dtype) not in caps.dtypes:
                raise BackendUnavailableError(
                    f"does not take {dtype} inputs (it declares {list(caps.dtypes)})",
                    hint=f"cast hidden and weight to one of {list(caps.dtypes)}",
                    **self._identity(),
                )
            self._check_required(caps, device)
            entry = self._caps[key] = (caps, frozenset(caps.outputs))
        return entry

    @_as_graph_constant
    def _prepare(self, device: torch.device, dtype: torch.dtype) -> str:
        """Under ``torch.compile``: Dynamo runs this eagerly (the backend's check and capabilities
        do not trace) and keeps the name of the attribute of ``_graph`` that holds the entry."""
        key = (device, dtype)
        name = self._graph_names.get(key)
        if name is None:
            entry = self._caps.get(key) or self._ready_entry(device, dtype)
            name = self._graph_names[key] = f"ready{next(_slot_numbers)}"
            setattr(self._graph, name, entry)
        return name

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float | torch.Tensor | None = None,
        ignore_index: int | None = None,
        return_entropy: bool | None = None,
        process_group: Any = None,
        vocab_start: int | None = None,
        vocab_size: int | None = None,
        reduce_hidden_grad: bool = True,
        check_labels: bool | None = None,
        softcap: float | None = None,
        top_k: int | None = None,
        gather_ids: torch.Tensor | None = None,
        return_lse: bool = False,
        return_sum_p2: bool = False,
        return_argmax: bool = False,
    ) -> FusedHeadOutput:
        cfg = self.config
        return self._call(
            hidden,
            weight,
            labels,
            cfg.temperature if temperature is None else temperature,
            cfg.ignore_index if ignore_index is None else ignore_index,
            cfg.return_entropy if return_entropy is None else return_entropy,
            process_group,
            vocab_start,
            vocab_size,
            reduce_hidden_grad,
            cfg.check_labels if check_labels is None else check_labels,
            cfg.softcap if softcap is None else softcap,
            top_k,
            gather_ids,
            return_lse,
            return_sum_p2,
            return_argmax,
            _tracing(),
        )

    def _call(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float | torch.Tensor,
        ignore_index: int,
        return_entropy: bool,
        process_group: Any,
        vocab_start: int | None,
        vocab_size: int | None,
        reduce_hidden_grad: bool,
        check_labels: bool,
        softcap: float | None,
        top_k: int | None,
        gather_ids: torch.Tensor | None,
        return_lse: bool,
        return_sum_p2: bool,
        return_argmax: bool,
        tracing: bool,
        /,
    ) -> FusedHeadOutput:
        """One call, arguments resolved and positional: the per-step path, kept to few tensor reads.

        ``tracing``: Dynamo traces the call (the caller asked ``_tracing()``, once per call)."""
        if tracing and isinstance(hidden, _Tensor):
            _prime_device(hidden.device)
        # The value checks' one host read (eager checked calls; on CUDA after forward has queued
        # the head's kernels, elsewhere before it): a traced call checks through the graph's
        # ops, an unchecked one (check_labels=False) reads nothing, a temperature tensor included.
        pending = Pending() if check_labels is True and not tracing else None
        call, shape, n, device, dtype, cast = validate(
            hidden,
            weight,
            labels,
            temperature,
            ignore_index,
            return_entropy,
            process_group,
            vocab_start,
            vocab_size,
            reduce_hidden_grad,
            check_labels,
            softcap,
            pending,
        )
        basic = (
            top_k is None
            and gather_ids is None
            and return_lse is False
            and return_sum_p2 is False
            and return_argmax is False
        )
        if not basic:
            shape = tuple(shape)  # a torch.Size from validate: messages show it as a tuple
            call = with_outputs(
                call,
                shape,
                top_k=top_k,
                gather_ids=gather_ids,
                return_lse=return_lse,
                return_sum_p2=return_sum_p2,
                return_argmax=return_argmax,
                check_labels=check_labels,
                pending=pending,
            )
            basic = call.outputs <= extras.BASIC_OUTPUTS
        if tracing:  # the first call on the pair resolves while Dynamo traces, not in the graph
            ready = getattr(self._graph, self._prepare(device, dtype))
        else:
            ready = self._caps.get((device, dtype)) or self._ready_entry(device, dtype)
        if not (
            basic
            and call.temperature.__class__ is float
            and call.temperature >= ready[0].min_temperature  # type: ignore[operator]
            and call.softcap is None
            and process_group is None
            and call.outputs <= ready[1]
        ):  # anything beyond a plain call: the full check (a plain one passes it by construction)
            call = self._check_call_capabilities(
                call, ready[0], pending, tracing and check_labels is True
            )
        if not n:
            return _empty(call, shape)
        if pending is not None:
            pending.send()
        try:
            if cast is None:
                out = self.backend.forward(call)
            else:
                with torch.autocast(cast, enabled=False):
                    out = self.backend.forward(call)
        except BackendError as exc:
            if pending is not None:
                pending.settle()  # a failed check is the cause to name, not what it broke
            raise exc.attach(**self._identity()) from None
        except Exception:
            if pending is not None:
                pending.settle()
            raise
        if pending is not None:
            pending.settle()
        # The output contract, as one expression over each tensor's properties read once; any
        # doubt goes to _check_output, which names the breach (and is the authority).
        h, w = call.hidden, call.weight
        needs_grad = (h.requires_grad or w.requires_grad) and _grad_enabled()
        # Eager: an output must have a graph (grad_fn; requires_grad alone can be a detached
        # leaf), and the first call per (device, dtype, outputs) walks it (_check_output).
        graph = needs_grad and not tracing
        ok = False
        if out.__class__ is HeadOutput:
            lp, ent = out.log_probs, out.entropy
            ok = (
                lp.__class__ is _Tensor
                and lp.dtype is _F32
                and lp.shape == (n,)
                and lp.device == device
                and (not needs_grad or lp.requires_grad)
                and (not graph or lp.grad_fn is not None)
            )
            if not ok:
                pass
            elif "entropy" in call.outputs:
                ok = (
                    ent.__class__ is _Tensor
                    and ent.dtype is _F32
                    and ent.shape == (n,)
                    and ent.device == device
                    and (not needs_grad or ent.requires_grad)
                    and (not graph or ent.grad_fn is not None)
                )
            else:
                ok = ent is None
            if ok and basic:
                ok = (
                    out.lse is None
                    and out.sum_p2 is None
                    and out.argmax is None
                    and out.topk_ids is None
                    and out.topk_log_probs is None
                    and out.gathered is None
                )
            elif ok:
                extras.check_extras(call, out, needs_grad, self._broke)
        if not ok or (graph and (device, h.dtype, call.outputs) not in self._attached):
            self._check_output(call, out, graph)
            lp, ent = out.log_probs, out.entropy
        if len(shape) != 1:  # [N] outputs in the labels' shape (an [N] output is that already)
            lp = _shaped(lp, shape)
            ent = None if ent is None else _shaped(ent, shape)
        if basic:
            return tuple.__new__(FusedHeadOutput, (lp, ent))  # type: ignore[no-any-return]
        return FusedHeadOutput(lp, ent, **extras.shaped_extras(call, out, shape))

    def kl(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        direction: str = "forward",
        temperature: float | torch.Tensor | None = None,
        teacher_temperature: float | torch.Tensor = 1.0,
        ignore_index: int | None = None,
        softcap: float | None = None,
        teacher_softcap: float | None = None,
        check_labels: bool | None = None,
    ) -> torch.Tensor:
        """Per-token fp32 KL between the student and the teacher head (see ``fused_kl``).

        The config describes the student's head: its ``temperature``, ``softcap``,
        ``ignore_index`` and ``check_labels`` apply where the call passes none, as in a head
        call; the teacher's temperature is 1.0 and its softcap none unless passed.
        ``check_labels`` also decides whether per-token temperatures' values are read and
        checked, as in a head call."""
        cfg = self.config
        check = cfg.check_labels if check_labels is None else check_labels
        call, shape = validate_kl(
            hidden,
            weight,
            teacher_hidden,
            teacher_weight,
            labels,
            temperature=cfg.temperature if temperature is None else temperature,
            teacher_temperature=teacher_temperature,
            ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
            direction=direction,
            softcap=cfg.softcap if softcap is None else softcap,
            teacher_softcap=teacher_softcap,
            check=check,
        )
        traced = _tracing()
        floor_read = Pending() if check is True and not traced else None
        if traced:
            caps = getattr(self._graph, self._prepare(call.hidden.device, call.hidden.dtype))[0]
        else:
            caps = self._ready(call.hidden.device, call.hidden.dtype)
        if call.direction not in caps.kl_directions:
            raise CapabilityError(
                f"does not compute the {call.direction} KL of two heads (it declares "
                f"kl_directions={list(caps.kl_directions)})",
                capability="kl_directions",
                hint="name a backend that declares it, e.g. 'torch'",
                **self._identity(),
            )
        for arg, temp in (
            ("temperature", call.temperature),
            ("teacher_temperature", call.teacher_temperature),
        ):
            if temp.__class__ is not float and not caps.per_token_temperature:
                raise CapabilityError(
                    f"does not support a per-token {arg} tensor",
                    capability="per_token_temperature",
                    hint="pass a float, or name a backend that declares per_token_temperature",
                    **self._identity(),
                )
            # per-token values: one more read where the call reads its checks (traced: a graph op)
            checked = self._check_min_temperature(
                arg, temp, caps, floor_read, traced and check is True
            )
            if checked is not temp:
                call = (
                    dataclasses.replace(call, temperature=checked)
                    if arg == "temperature"
                    else dataclasses.replace(call, teacher_temperature=checked)
                )
        if floor_read is not None:
            floor_read.send()
            floor_read.settle()
        for arg, cap in (("softcap", call.softcap), ("teacher_softcap", call.teacher_softcap)):
            if cap is not None and not caps.softcap:
                raise CapabilityError(
                    f"does not support {arg} in the KL of two heads",
                    capability="softcap",
                    hint=f"drop {arg}, or name a backend that declares softcap, e.g. 'torch'",
                    **self._identity(),
                )
        if call.valid.numel() == 0:
            zero = call.hidden.sum(-1).float() * 0 + call.weight.sum().float() * 0
            return _shaped(zero, shape)
        method = getattr(self.backend, "kl", None)
        if not callable(method):
            self._broke("declares kl_directions but has no kl(call) method")
        dev = call.hidden.device.type
        try:
            if dev in _AUTOCAST_DEVICES and torch.is_autocast_enabled(dev):
                with torch.autocast(dev, enabled=False):
                    out = method(call)
            else:
                out = method(call)
        except BackendError as exc:
            raise exc.attach(**self._identity()) from None
        needs_grad = torch.is_grad_enabled() and (
            call.hidden.requires_grad or call.weight.requires_grad
        )
        inputs = None if traced else {"hidden": call.hidden, "weight": call.weight}
        extras.check_kl(
            out, call.valid.shape[0], call.hidden.device, needs_grad, self._broke, inputs
        )
        return _shaped(out.kl, shape)

    def policy_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        temperature: float | torch.Tensor | None = None,
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
        cu_seqlens: torch.Tensor | None = None,
        ignore_index: int | None = None,
        softcap: float | None = None,
    ) -> policy.PolicyLossOutput:
        """The policy loss with its gradients computed in the forward (see ``fused_policy_loss``);
        the config's ``temperature``, ``ignore_index``, ``softcap`` and ``check_labels`` apply
        where the call passes none."""
        cfg = self.config
        return policy.run(
            self,
            hidden,
            weight,
            labels,
            temperature=cfg.temperature if temperature is None else temperature,
            ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
            softcap=cfg.softcap if softcap is None else softcap,
            check_labels=cfg.check_labels,
            old_log_probs=old_log_probs,
            advantages=advantages,
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
            cu_seqlens=cu_seqlens,
        )

    def _check_call_capabilities(
        self,
        call: HeadCall,
        caps: Capabilities,
        pending: Pending | None = None,
        traced: bool = False,
    ) -> HeadCall:
        """Refuse what ``caps`` does not declare, by name; the call to go on with (traced, its
        per-token temperature passes through the graph's ``min_temperature`` check)."""
        if call.temperature.__class__ is not float and not caps.per_token_temperature:
            raise CapabilityError(
                "does not support a per-token temperature tensor",
                capability="per_token_temperature",
                hint="pass a float, or name a backend that declares per_token_temperature, e.g. 'torch'",
                **self._identity(),
            )
        temp = self._check_min_temperature("temperature", call.temperature, caps, pending, traced)
        if temp is not call.temperature:
            call = call._replace(temperature=temp)
        if call.softcap is not None and not caps.softcap:
            raise CapabilityError(
                "does not support softcap",
                capability="softcap",
                hint="name a backend that declares softcap, e.g. 'torch'",
                **self._identity(),
            )
        missing = call.outputs.difference(caps.outputs)
        if missing:
            raise CapabilityError(
                f"does not compute the requested outputs {sorted(missing)} (it declares "
                f"{list(caps.outputs)})",
                capability=sorted(missing)[0],
                hint="drop them from the call, or name a backend that declares them",
                **self._identity(),
            )
        refusal = extras.capability_refusal(call, caps)
        if refusal is not None:
            reason, capability, hint = refusal
            raise CapabilityError(reason, capability=capability, hint=hint, **self._identity())
        group = call.process_group
        if group is not None:
            if not caps.vocab_parallel:
                raise CapabilityError(
                    "does not support process_group",
                    capability="vocab_parallel",
                    hint="name a backend that declares vocab_parallel, e.g. 'torch' or 'triton'",
                    **self._identity(),
                )
            if not caps.uneven_shards:
                import torch.distributed as dist

                v = call.weight.shape[0]
                rank, world = dist.get_rank(group), dist.get_world_size(group)
                if (call.vocab_start, call.vocab_size) != (rank * v, world * v):
                    raise CapabilityError(
                        f"needs equal contiguous vocabulary shards; got vocab_start={call.vocab_start}, "
                        f"vocab_size={call.vocab_size} for {v} local rows on rank {rank} of {world}",
                        capability="uneven_shards",
                        hint="shard the vocabulary evenly, or name a backend that declares uneven_shards",
                        **self._identity(),
                    )
        return call

    def _check_output(self, call: HeadCall, out: object, graph: bool = False) -> None:
        """The backend's output against the contract; any breach is a ``BackendContractError``.

        ``graph`` (an eager call recording gradients): each differentiable output's autograd
        graph must reach hidden and weight (``extras.graph_breach``); once it has, later calls
        on the same (device, dtype, outputs) only check that each has a ``grad_fn``."""
        if out.__class__ is not HeadOutput and not isinstance(out, HeadOutput):
            self._broke(
                f"forward() must return a fusedhead.protocol.HeadOutput, got {_describe(out)}"
            )
        h, w = call.hidden, call.weight
        n = call.labels.shape[0]
        device = h.device
        needs_grad = (h.requires_grad or w.requires_grad) and torch.is_grad_enabled()
        graph = graph and needs_grad
        inputs = {"hidden": h, "weight": w} if graph else None
        self._check_tensor("log_probs", out.log_probs, n, device, needs_grad, inputs)
        if "entropy" in call.outputs:
            self._check_tensor("entropy", out.entropy, n, device, needs_grad, inputs)
        elif out.entropy is not None:
            self._broke("entropy was not requested and must be None")
        if not call.outputs <= extras.BASIC_OUTPUTS or not (
            out.lse is None
            and out.sum_p2 is None
            and out.argmax is None
            and out.topk_ids is None
            and out.topk_log_probs is None
            and out.gathered is None
        ):
            extras.check_extras(call, out, needs_grad, self._broke, graph)
        if graph:
            self._attached.add((device, h.dtype, call.outputs))

    def _check_tensor(
        self,
        what: str,
        t: object,
        n: int,
        device: torch.device,
        needs_grad: bool,
        inputs: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if t.__class__ is not torch.Tensor and not isinstance(t, torch.Tensor):
            self._broke(f"{what} must be a float32 [{n}] tensor, got {_describe(t)}")
        if t.dtype is not torch.float32 or t.dim() != 1 or t.shape[0] != n or t.device != device:
            self._broke(
                f"{what} must be float32 [{n}] on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if needs_grad and not t.requires_grad:
            self._broke(
                f"{what} does not require grad although hidden or weight does: the backend "
                "detached it, so no gradient would reach the model"
            )
        if inputs is not None:
            breach = extras.graph_breach(what, t, inputs)
            if breach is not None:
                self._broke(breach)

    def _check_min_temperature(
        self,
        arg: str,
        temp: float | torch.Tensor,
        caps: Capabilities,
        pending: Pending | None,
        traced: bool = False,
    ) -> float | torch.Tensor:
        """``temp`` at least the backend's ``min_temperature``: a float now; a per-token tensor in
        ``pending``'s one read, or (``traced``: a checked call Dynamo traces) as an op of the graph,
        whose checked copy is returned; no read otherwise (``check_labels=False``)."""
        floor = caps.min_temperature
        if floor <= SCALAR_RANGE[0]:
            return temp  # the core's own range, already checked
        if isinstance(temp, torch.Tensor):
            if pending is not None:
                pending.add((temp < floor).any(), self._below_min_temperature, arg, temp, floor)
            elif traced:
                checked: torch.Tensor = _min_temperature_checked(
                    temp, floor, arg, self.name or "", self.distribution or "", self.version or ""
                )
                return checked
        elif temp < floor:
            self._below_min_temperature(arg, temp, floor)
        return temp

    def _below_min_temperature(
        self, arg: str, temp: float | torch.Tensor, floor: float
    ) -> NoReturn:
        _raise_below_min_temperature(arg, temp, floor, self._identity())

    def _broke(self, reason: str) -> NoReturn:
        raise BackendContractError(
            f"broke the plugin contract: {reason}",
            hint="report this to the backend's authors; `fusedhead check NAME` runs the conformance kit",
            **self._identity(),
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, tuple):
        return f"a {len(value)}-tuple"
    return f"{type(value).__name__} {value!r}"[:120]


# Module constants for the per-call path (a global read, not a global and an attribute).
_Tensor = torch.Tensor
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled

#: Device types with an autocast mode (``torch.is_autocast_enabled`` raises for others, e.g. meta).
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu", "mps", "xla", "mtia", "ipu"})


def _shaped(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` in the labels' shape, never as a view (FSDP2 and in-place ops mishandle view outputs)."""
    if tuple(out.shape) == shape:
        return out
    return out.reshape(shape).clone()


def _empty(call: HeadCall, shape: tuple[int, ...]) -> FusedHeadOutput:
    """N = 0: empty fp32 outputs that still belong to the autograd graph (zero gradients)."""
    zero = call.hidden.sum(-1).float() * 0 + call.weight.sum().float() * 0
    out = _shaped(zero, shape)
    return FusedHeadOutput(
        out, out.clone() if call.return_entropy else None, **extras.empty_extras(call, shape, out)
    )


#: Resolved heads by (backend, options key), and by ("mapping" | "config", text, None) for
#: ``cached_head`` (three items: never equal to a backend's key, whatever the backend's name).
_cache: dict[tuple[Any, ...], FusedHead] = {}
_lock = threading.RLock()  # cached_head resolves a mapping through the config path

#: Option values a key holds as themselves (class included: 1, 1.0 and True are three keys, as
#: their JSON texts are); anything else (nested lists and mappings, ...) goes through JSON.
_FLAT = (str, int, float, bool, type(None))

#: True while Dynamo traces (it folds the call), a plain ``return False`` eagerly: the one test
#: the eager hot path pays for the compiled one (30 ns, against 70 for ``is_compiling``, which
#: stands in on a torch without it).
_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


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
    """The cache key of a backend's options: flat ones as a tuple, the rest as sorted JSON text."""
    if options is None:
        return ()
    if isinstance(options, BaseModel):
        options = options.model_dump(mode="json")
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, got {type(options).__name__}")
    key = _flat_key(options)
    if key is not None:
        return key
    return json.dumps(dict(options), sort_keys=True, default=repr)


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
                head = FusedHead(FusedHeadConfig._from_arguments(backend=backend, options=opts))
                _cache[key] = head
    return head


#: The cache's heads as compiled graphs read them (``_Slots``), and their names by key.
_graph = _Slots()
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
        name = _graph_names[key] = f"head{next(_slot_numbers)}"
        setattr(_graph, name, head)
    return name


@_as_graph_constant
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
                    head = FusedHead(config)
                else:  # a mapping: validated into a config, which has its own entry
                    head = cached_head(FusedHeadConfig.from_dict(dict(config or {})))
                _cache[key] = head
    return head


def _config_key(config: object) -> tuple[str, str, None]:
    """``cached_head``'s key: a mapping by its own text, a ``FusedHeadConfig`` by its dict's."""
    if config is None or isinstance(config, Mapping):
        raw = {} if config is None else dict(config)
        return ("mapping", json.dumps(raw, sort_keys=True, default=repr), None)
    if not isinstance(config, FusedHeadConfig):
        raise TypeError(
            "config must be a FusedHeadConfig, a mapping, a FusedHead or None, "
            f"got {type(config).__name__}"
        )
    return ("config", json.dumps(config.to_dict(), sort_keys=True, default=repr), None)


@_as_graph_constant
def _config_key_in_trace(config: Any) -> str:
    """``cached_head``'s part that Dynamo runs while it traces (see ``_key_in_trace``)."""
    head = cached_head(config)
    return _slot(_config_key(config), head)


def _forget() -> None:
    """``refresh()``: every resolved head dropped; a graph that read one retraces on its next call."""
    with _lock:
        _cache.clear()
        _graph_names.clear()
        vars(_graph).clear()


registry.on_refresh(_forget)


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
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(backend).__name__} {backend!r}"
        )
    if temperature is None:
        raise TypeError("temperature must be a float or a tensor, got None")
    tracing = _tracing()
    # Without options the key is known: the cache's own entry, without building it anew.
    head = None if tracing or options is not None else _cache.get((backend, ()))
    if head is None:
        head = _traced_head(backend, options) if tracing else get_fused_head(backend, options)
    return head._call(
        hidden,
        weight,
        labels,
        temperature,
        ignore_index,
        return_entropy,
        process_group,
        vocab_start,
        vocab_size,
        reduce_hidden_grad,
        check_labels,
        softcap,
        top_k,
        gather_ids,
        return_lse,
        return_sum_p2,
        return_argmax,
        tracing,
    )


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
    return get_fused_head(backend, options).kl(
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


def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    old_log_probs: torch.Tensor,
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
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    options: Mapping[str, Any] | BaseModel | None = None,
) -> policy.PolicyLossOutput:
    """The PPO/GRPO policy loss of ``hidden @ weight.T / temperature``, its gradients computed in
    the forward: three GEMMs per token chunk, no ``[N, V]`` tensor (docs/policy-loss.md).

    verl's semantics: ratio ``exp(lp - old_log_probs)``, clipped surrogate (``clip_low``,
    ``clip_high``, ``dual_clip`` for negative advantages), truncated importance sampling
    (``rollout_log_probs``, ``tis_cap``), ``- entropy_coef`` times the entropy, ``+ kl_coef`` times
    the ``kl_estimator`` KL to ``ref_log_probs``, each aggregated by ``aggregation`` (verl's
    ``loss_agg_mode``; ``cu_seqlens`` for a packed batch, ``loss_normalizer`` for the global count).
    Rows whose label is ``ignore_index`` add nothing. The backend must declare ``policy_loss``.
    """
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(backend).__name__} {backend!r}"
        )
    if temperature is None:
        raise TypeError("temperature must be a float or a tensor, got None")
    return get_fused_head(backend, options).policy_loss(
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
        cu_seqlens=cu_seqlens,
        ignore_index=ignore_index,
        softcap=softcap,
    )
