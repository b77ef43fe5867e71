"""``FusedHead``: a backend resolved once from a ``FusedHeadConfig``, then called per step.

A call arrives as a request (``fusedhead.request``), is checked into the backend's call
(``validation``), passes the capability gate and, after the backend ran, the output contract
(both in ``fusedhead.contract``), and leaves in the labels' shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from fusedhead import contract, policy, policy_args, policy_output, rank_agreement, registry
from fusedhead.checks import DEVICES, device_arg, device_entry, dtype_name, usable_device
from fusedhead.config import FusedHeadConfig
from fusedhead.contract import FusedHeadOutput
from fusedhead.cpu_math import resolve_vml_dispatch
from fusedhead.errors import (
    BackendContractError,
    BackendError,
    BackendUnavailableError,
    CapabilityError,
    note_backend,
)
from fusedhead.graph import Slots, as_graph_constant, slot_numbers, tracing
from fusedhead.hooks import plugin_manager
from fusedhead.keywords import known_keywords
from fusedhead.protocol import Capabilities
from fusedhead.request import CONFIGURED, HeadRequest, KLRequest, PolicyRequest, head_request
from fusedhead.validation import check_head, check_kl
from fusedhead.value_checks import Pending

# Module constants for the per-call path (a global read, not a global and an attribute).
_Tensor = torch.Tensor
_BASIC = contract.BASIC_OUTPUTS
_output_ok = contract.output_ok
_new_tuple = tuple.__new__

#: Device types with an autocast mode (``torch.is_autocast_enabled`` raises for others, e.g. meta).
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "hpu", "mps", "xla", "mtia", "ipu"})


@as_graph_constant
def _prime_device(device: torch.device) -> None:
    """Under ``torch.compile``, before ``check_head`` reads its table of devices: the entry made
    eagerly (a table the trace found without it would be guarded so, and the next call retrace)."""
    if device not in DEVICES:
        device_entry(device)


#: Other trainers' keyword arguments of a head call, each told what it is here.
HEAD_FOREIGN_KEYWORDS = {
    "calculate_entropy": "verl's name of return_entropy",
    "compute_entropy": "TRL's name of return_entropy",
    "input_ids": "the tokens: pass labels, the next token of each row (ignore_index where none)",
}


class FusedHead:
    """A backend resolved once from a ``FusedHeadConfig``, then called per step."""

    def __init__(
        self, config: FusedHeadConfig | Mapping[str, Any] | None = None, **overrides: Any
    ) -> None:
        if config is None:  # keyword arguments: an error names the argument
            config = FusedHeadConfig.from_arguments(**overrides)
        elif isinstance(config, Mapping):
            config = FusedHeadConfig.from_dict({**config, **overrides})
        elif isinstance(config, FusedHeadConfig):
            if overrides:  # an error names the override as the argument it is
                config = FusedHeadConfig.from_arguments(**{**config.to_dict(), **overrides})
        else:
            raise TypeError(
                f"config must be a FusedHeadConfig or a mapping, got {type(config).__name__}"
            )
        resolved = registry.resolve(config.backend, config.options, config.resolved)
        # The head's own copy, its options the ones it runs: a caller's config whose options
        # dict is changed in place later neither changes the head nor its reported settings.
        self.config = config.model_copy(
            update={
                "options": resolved.options.model_dump(mode="json", exclude_unset=True),
                "require": list(config.require),
            }
        )
        self.config._resolved = resolved
        self.distribution = resolved.entry.distribution
        self.version = resolved.entry.version
        self.options = resolved.options
        self.backend = registry.construct_backend(resolved.cls, self.options, **self.identity())
        self._caps: dict[tuple[torch.device, torch.dtype], tuple[Capabilities, frozenset[str]]] = {}
        # (device, dtype, (caps, outputs)); the first call's device None never matches
        self._last: tuple[Any, Any, Any] = (None, None, None)
        self._graph = Slots()  # _caps's entries for compiled graphs (see _prepare)
        self._graph_names: dict[tuple[torch.device, torch.dtype], str] = {}
        # (device, dtype, outputs) whose outputs' autograd graphs were seen to reach hidden and
        # weight (contract.check_output, on the first eager call with gradients; later calls
        # check that each output has a grad_fn).
        self._attached: set[tuple[torch.device, torch.dtype, frozenset[str]]] = set()
        # A device this process cannot use is refused here, where it is first used (the config
        # itself only parses it: a config file travels between machines).
        device = usable_device(config.device) if config.device else registry.default_device()
        caps = self.capabilities(device)
        self._check_required(caps, device)
        plugin_manager().hook.fusedhead_backend_resolved(
            name=config.backend,
            distribution=self.distribution,
            version=self.version,
            options=self.options.model_dump(mode="json"),
            capabilities=caps.model_dump(mode="json"),
        )

    @property
    def name(self) -> str:
        return self.config.backend

    def __repr__(self) -> str:
        return f"FusedHead(backend={self.name!r}, distribution={self.distribution!r}, version={self.version!r})"

    def identity(self) -> dict[str, str | None]:
        """The backend's identity as its errors carry it: backend, distribution, version."""
        return {"backend": self.name, "distribution": self.distribution, "version": self.version}

    @contextmanager
    def _identified(self, what: str) -> Iterator[None]:
        """Errors from the backend method ``what`` carry its identity; other exceptions become
        ``BackendContractError`` (a method that must only raise ``BackendError``)."""
        try:
            yield
        except BackendError as exc:
            raise exc.attach(**self.identity()) from None
        except Exception as exc:
            raise BackendContractError(
                f"{what} raised {type(exc).__name__}: {exc}",
                hint="a backend's check() must raise fusedhead.errors.BackendUnavailableError with "
                "the reason and the fix; report this to the backend's authors",
                **self.identity(),
            ) from exc

    def broke(self, reason: str) -> NoReturn:
        """Raise the ``BackendContractError`` of this backend's breach of the plugin contract."""
        contract.broke(reason, self.identity())

    def capabilities(self, device: torch.device | str) -> Capabilities:
        """The backend's capabilities on ``device`` (a plugin that breaks the contract there, by
        raising or by returning something else, is a ``BackendContractError`` naming it)."""
        dev = device if device.__class__ is torch.device else device_arg("device", device)
        caps: Capabilities = registry.backend_capabilities(self.backend, dev, **self.identity())
        return caps

    def _check_required(self, caps: Capabilities, device: torch.device) -> None:
        missing = [c for c in self.config.require if not getattr(caps, c, False)]
        if missing:
            raise CapabilityError(
                f"does not declare the required capabilities {missing} on {device}",
                capability=missing[0],
                hint="fusedhead never picks another backend for you: choose one that declares "
                "them, or drop the requirement",
                **self.identity(),
            )

    def ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities:
        """Capabilities on (device, dtype), after the backend's own check; cached per pair. While
        Dynamo traces, the check runs eagerly (``_prepare``): a backend's check is not traced."""
        return self._entry(device, dtype, torch.compiler.is_compiling())[0]

    def _ready_entry(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[Capabilities, frozenset[str]]:
        """The first call on (device, dtype): the backend's check, then its capabilities there
        (and their outputs as a set), cached for every later call on the pair."""
        key = (device, dtype)
        entry = self._caps.get(key)
        if entry is None:
            if device.type == "cpu":
                resolve_vml_dispatch()  # before the first parallel exp (pytorch#188792)
            with self._identified("check()"):
                # first: its message carries the reason and the fix
                self.backend.check(device, dtype)
            caps = self.capabilities(device)
            if device.type not in caps.devices:
                raise BackendUnavailableError(
                    f"does not run on device type {device.type!r} (it declares {list(caps.devices)})",
                    hint=f"move hidden and weight to one of {list(caps.devices)}, or name a backend "
                    f"that runs on {device.type!r}",
                    **self.identity(),
                )
            if dtype_name(dtype) not in caps.dtypes:
                raise BackendUnavailableError(
                    f"does not take {dtype} inputs (it declares {list(caps.dtypes)})",
                    hint=f"cast hidden and weight to one of {list(caps.dtypes)}",
                    **self.identity(),
                )
            self._check_required(caps, device)
            entry = self._caps[key] = (caps, frozenset(caps.outputs))
        return entry

    @as_graph_constant
    def _prepare(self, device: torch.device, dtype: torch.dtype) -> str:
        """Under ``torch.compile``: Dynamo runs this eagerly (the backend's check and capabilities
        do not trace) and keeps the name of the attribute of ``_graph`` that holds the entry."""
        key = (device, dtype)
        name = self._graph_names.get(key)
        if name is None:
            entry = self._caps.get(key) or self._ready_entry(device, dtype)
            name = self._graph_names[key] = f"ready{next(slot_numbers)}"
            setattr(self._graph, name, entry)
        return name

    def _entry(
        self, device: torch.device, dtype: torch.dtype, traced: bool
    ) -> tuple[Capabilities, frozenset[str]]:
        """``_ready_entry`` as a call reads it: from the graph's slot when Dynamo traces."""
        if traced:  # the first call on the pair resolves while Dynamo traces, not in the graph
            return getattr(self._graph, self._prepare(device, dtype))  # type: ignore[no-any-return]
        return self._caps.get((device, dtype)) or self._ready_entry(device, dtype)

    def request(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **options: Any
    ) -> HeadRequest:
        """A head call's request, options named as ``__call__`` names them; a configured one
        (temperature, ignore_index, return_entropy, check_labels, softcap) left None takes the
        config's value."""
        cfg = self.config
        for name in CONFIGURED:
            if options.get(name) is None:
                options[name] = getattr(cfg, name)
        return HeadRequest(hidden, weight, labels, **options)

    @known_keywords(HEAD_FOREIGN_KEYWORDS)
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
        """Log-probs and entropy of ``labels`` (as ``fused_head``), None arguments taking the config's."""
        return self.run(head_request(locals(), self.config))

    def run(self, req: HeadRequest) -> FusedHeadOutput:
        """One head call: the request checked into the backend's call, gated, run, its output
        checked and shaped. The per-step path, kept to few tensor reads."""
        check = req.check_labels
        traced = tracing()
        if traced and isinstance(req.hidden, _Tensor):
            _prime_device(req.hidden.device)
        # The value checks' one host read (eager checked calls; on CUDA after forward has queued
        # the head's kernels, elsewhere before it): a traced call checks through the graph's
        # ops, an unchecked one (check_labels=False) reads nothing, a temperature tensor included.
        pending = Pending() if check is True and not traced else None
        try:
            call, shape, n, device, dtype, cast, needs_grad, plain = check_head(req, pending)
            last = self._last  # the previous call's (device, dtype, entry): most calls repeat it
            if traced:  # the first call on the pair resolves while Dynamo traces, not in the graph
                caps, outputs = self._entry(device, dtype, True)
            elif last[1] is dtype and last[0] == device:
                caps, outputs = last[2]
            else:
                entry = self._caps.get((device, dtype)) or self._ready_entry(device, dtype)
                self._last = (device, dtype, entry)
                caps, outputs = entry
            if not (
                plain
                and call.temperature >= caps.min_temperature  # type: ignore[operator]
                and call.outputs <= outputs
            ):  # anything beyond a plain call: the full gate (a plain one passes it so)
                call = contract.gate_head(
                    call, caps, self.identity(), pending, traced and check is True
                )
        except Exception:
            # the other ranks' checked calls wait in the agreement's gather: tell them (a
            # check_labels that is no bool is refused here too, with no Pending made)
            if req.process_group is not None and check is not False and not traced:
                rank_agreement.refused(req.process_group, req.hidden)  # the others raise too
            raise
        # A checked vocab-parallel call's ranks agree before any collective of the backend: each
        # raises where one rank's call differs or fails its value checks (rank_agreement), which
        # leaves no check to read afterwards. Unchecked values are safe to run (NaN rows).
        if call.process_group is not None and pending is not None:
            rank_agreement.agree(call, dtype, needs_grad, pending, self.name)
            pending = None
        if not n:
            return contract.empty_output(call, shape)
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
            raise exc.attach(**self.identity()) from None
        except Exception as exc:
            if pending is not None:
                pending.settle()
            note_backend(exc, **self.identity())
            raise
        if pending is not None:
            pending.settle()
        basic = plain or call.outputs <= _BASIC
        # Eager: an output must have a graph (grad_fn; requires_grad alone can be a detached
        # leaf), and the first call per (device, dtype, outputs) walks it (check_output).
        graph = needs_grad and not traced
        walk = graph and (device, dtype, call.outputs) not in self._attached
        if (walk or not _output_ok(call, out, n, device, needs_grad, graph, basic)) and (
            contract.check_output(call, out, graph, self.identity(), walk)
        ):
            self._attached.add((device, dtype, call.outputs))
        if not basic:
            return contract.shaped_output(call, out, tuple(shape))
        lp, ent = out.log_probs, out.entropy
        if len(shape) != 1:  # [N] outputs in the labels' shape (an [N] output is that already)
            lp = contract.shaped(lp, shape)
            ent = None if ent is None else contract.shaped(ent, shape)
        return _new_tuple(FusedHeadOutput, (lp, ent))  # type: ignore[no-any-return]

    @known_keywords({})
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
        return self.run_kl(
            KLRequest(
                hidden,
                weight,
                teacher_hidden,
                teacher_weight,
                labels,
                direction=direction,
                temperature=cfg.temperature if temperature is None else temperature,
                teacher_temperature=teacher_temperature,
                ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
                softcap=cfg.softcap if softcap is None else softcap,
                teacher_softcap=teacher_softcap,
                check_labels=cfg.check_labels if check_labels is None else check_labels,
            )
        )

    def run_kl(self, req: KLRequest) -> torch.Tensor:
        """One KL call: checked, gated as a head call is, run, its output checked and shaped."""
        traced = tracing()
        check = req.check_labels is True
        # The labels' range, per-token temperatures and the backend's floor: one host read.
        pending = Pending() if check and not traced else None
        call, shape = check_kl(req, pending)
        caps = self._entry(call.hidden.device, call.hidden.dtype, traced)[0]
        call = contract.gate_kl(call, caps, self.identity(), pending, traced and check)
        if pending is not None:
            pending.send()
            pending.settle()
        if call.valid.numel() == 0:
            zero = call.hidden.sum(-1).float() * 0 + call.weight.sum().float() * 0
            return contract.shaped(zero, shape)
        method = self.backend.kl  # there: the registry checks it where capabilities are read
        dev = call.hidden.device.type
        try:
            if dev in _AUTOCAST_DEVICES and torch.is_autocast_enabled(dev):
                with torch.autocast(dev, enabled=False):
                    out = method(call)
            else:
                out = method(call)
        except BackendError as exc:
            raise exc.attach(**self.identity()) from None
        except Exception as exc:
            note_backend(exc, **self.identity())
            raise
        needs_grad = torch.is_grad_enabled() and (
            call.hidden.requires_grad or call.weight.requires_grad
        )
        contract.check_kl(out, call, needs_grad, not traced, self.identity())
        return contract.shaped(out.kl, shape)

    @known_keywords(policy_args.FOREIGN_KEYWORDS)
    def policy_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        old_log_probs: torch.Tensor | None,
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
        horizon: float | None = None,
        cu_seqlens: torch.Tensor | None = None,
        ignore_index: int | None = None,
        softcap: float | None = None,
    ) -> policy_output.PolicyLossOutput:
        """The policy loss with its gradients computed in the forward (see ``fused_policy_loss``,
        whose arguments it takes but ``backend`` and ``options``, which the head holds); the
        config's ``temperature``, ``ignore_index`` and ``softcap`` apply where the call passes
        None, and its ``check_labels`` always (the call takes no such argument)."""
        cfg = self.config
        return self.run_policy_loss(
            PolicyRequest(
                hidden,
                weight,
                labels,
                old_log_probs=old_log_probs,
                advantages=advantages,
                temperature=cfg.temperature if temperature is None else temperature,
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
                ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
                softcap=cfg.softcap if softcap is None else softcap,
                check_labels=cfg.check_labels,
            )
        )

    def run_policy_loss(self, req: PolicyRequest) -> policy_output.PolicyLossOutput:
        """One policy-loss call (``policy.run``: checked, gated, run, the loss formed)."""
        return policy.run(self, req)
