"""The contract: ``fused_head(...)`` and the ``FusedHead`` object that resolves its backend once."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel

from fusedhead import registry
from fusedhead.config import FusedHeadConfig, validate_options
from fusedhead.errors import BackendError, BackendUnavailableError, CapabilityError
from fusedhead.hooks import plugin_manager
from fusedhead.protocol import Capabilities
from fusedhead.validation import Call, dtype_name, validate


class FusedHeadOutput(NamedTuple):
    """Per-token fp32 log-probabilities of the labels and entropies (None when not asked for)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class FusedHead:
    """A backend resolved once from a ``FusedHeadConfig``, then called per step."""

    def __init__(
        self, config: FusedHeadConfig | Mapping[str, Any] | None = None, **overrides: Any
    ) -> None:
        if config is None:
            config = FusedHeadConfig(**overrides)
        elif isinstance(config, Mapping):
            config = FusedHeadConfig.from_dict({**config, **overrides})
        elif overrides:
            config = FusedHeadConfig.from_dict({**config.to_dict(), **overrides})
        if not isinstance(config, FusedHeadConfig):
            raise TypeError(
                f"config must be a FusedHeadConfig or a mapping, got {type(config).__name__}"
            )
        self.config = config
        cand = registry.find(config.backend)
        cls = registry.load_class(config.backend)
        self.options = validate_options(config.backend, cls, config.options)
        self.backend = cls(self.options)
        self.distribution = cand.distribution
        self.version = cand.version
        self._caps: dict[tuple[torch.device, torch.dtype], Capabilities] = {}
        device = torch.device(config.device) if config.device else registry.default_device()
        caps = self.backend.capabilities(device)
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

    def capabilities(self, device: torch.device | str) -> Capabilities:
        """The backend's capabilities on ``device``."""
        caps: Capabilities = self.backend.capabilities(torch.device(device))
        return caps

    def _check_required(self, caps: Capabilities, device: torch.device) -> None:
        missing = [c for c in self.config.require if not getattr(caps, c, False)]
        if missing:
            raise CapabilityError(
                f"backend {self.name!r} does not declare required capabilities {missing} on {device}; "
                "fusedhead never picks another backend for you: choose one that declares them or drop the requirement"
            )

    def _ready(self, device: torch.device, dtype: torch.dtype) -> Capabilities:
        """Capabilities on (device, dtype), after the backend's own check; cached per pair."""
        key = (device, dtype)
        caps = self._caps.get(key)
        if caps is None:
            self.backend.check(device, dtype)  # first: its message carries the reason and the fix
            caps = self.backend.capabilities(device)
            if device.type not in caps.devices:
                raise BackendUnavailableError(
                    f"backend {self.name!r} does not run on device type {device.type!r} (it declares {list(caps.devices)})"
                )
            if dtype_name(dtype) not in caps.dtypes:
                raise BackendUnavailableError(
                    f"backend {self.name!r} does not take {dtype} inputs (it declares {list(caps.dtypes)})"
                )
            self._check_required(caps, device)
            self._caps[key] = caps
        return caps

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
    ) -> FusedHeadOutput:
        cfg = self.config
        return_entropy = cfg.return_entropy if return_entropy is None else return_entropy
        call = validate(
            hidden,
            weight,
            labels,
            temperature=cfg.temperature if temperature is None else temperature,
            ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
            return_entropy=return_entropy,
            process_group=process_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            reduce_hidden_grad=reduce_hidden_grad,
            check_labels=cfg.check_labels if check_labels is None else check_labels,
            softcap=cfg.softcap if softcap is None else softcap,
        )
        caps = self._ready(call.hidden.device, call.hidden.dtype)
        self._check_call_capabilities(call, caps, process_group)
        if call.labels.numel() == 0:
            return _empty(call, return_entropy)
        extra: dict[str, Any] = {} if call.softcap is None else {"softcap": call.softcap}
        dev = call.hidden.device.type
        with (
            torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else _nullcontext()
        ):
            log_probs, entropy = self.backend.forward(
                call.hidden,
                call.weight,
                call.labels,
                temperature=call.temperature,
                ignore_index=cfg.ignore_index if ignore_index is None else ignore_index,
                return_entropy=return_entropy,
                process_group=process_group,
                vocab_start=call.vocab_start,
                vocab_size=call.vocab_size,
                reduce_hidden_grad=reduce_hidden_grad,
                **extra,
            )
        n = call.labels.shape[0]
        self._check_output("log_probs", log_probs, n)
        if return_entropy:
            self._check_output("entropy", entropy, n)
            assert entropy is not None
            entropy = _shaped(entropy, call.out_shape)
        else:
            entropy = None
        return FusedHeadOutput(_shaped(log_probs, call.out_shape), entropy)

    def _check_call_capabilities(self, call: Call, caps: Capabilities, process_group: Any) -> None:
        if isinstance(call.temperature, torch.Tensor) and not caps.per_token_temperature:
            raise CapabilityError(
                f"backend {self.name!r} does not support a per-token temperature tensor "
                "(capability per_token_temperature); pass a float or use a backend that declares it, e.g. 'torch'"
            )
        if call.softcap is not None and not caps.softcap:
            raise CapabilityError(
                f"backend {self.name!r} does not support softcap (capability softcap); use one that declares it, e.g. 'torch'"
            )
        if process_group is not None:
            if not caps.vocab_parallel:
                raise CapabilityError(
                    f"backend {self.name!r} does not support process_group (capability vocab_parallel)"
                )
            if not caps.uneven_shards:
                import torch.distributed as dist

                v = call.weight.shape[0]
                rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
                if (call.vocab_start, call.vocab_size) != (rank * v, world * v):
                    raise CapabilityError(
                        f"backend {self.name!r} needs equal contiguous vocabulary shards (capability uneven_shards); "
                        f"got vocab_start={call.vocab_start}, vocab_size={call.vocab_size} for {v} local rows on rank {rank} of {world}"
                    )

    def _check_output(self, what: str, out: object, n: int) -> None:
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.float32
            or tuple(out.shape) != (n,)
        ):
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else repr(out)
            raise BackendError(
                f"backend {self.name!r} broke the contract: {what} must be float32 [{n}], got {got}"
            )


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _shaped(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` in the labels' shape, never as a view (FSDP2 and in-place ops mishandle view outputs)."""
    if tuple(out.shape) == shape:
        return out
    return out.reshape(shape).clone()


def _empty(call: Call, return_entropy: bool) -> FusedHeadOutput:
    """N = 0: empty fp32 outputs that still belong to the autograd graph (zero gradients)."""
    zero = call.hidden.sum(-1).float() * 0 + call.weight.sum().float() * 0
    out = _shaped(zero, call.out_shape)
    return FusedHeadOutput(out, out.clone() if return_entropy else None)


_cache: dict[tuple[str, str], FusedHead] = {}
_lock = threading.Lock()


def _options_key(options: Any) -> str:
    if options is None:
        return "{}"
    if isinstance(options, BaseModel):
        options = options.model_dump(mode="json")
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, got {type(options).__name__}")
    return json.dumps(dict(options), sort_keys=True, default=repr)


def get_fused_head(backend: str, options: Mapping[str, Any] | BaseModel | None = None) -> FusedHead:
    """The process-wide ``FusedHead`` for (backend, options); resolved, and observed, once."""
    key = (backend, _options_key(options))
    head = _cache.get(key)
    if head is None:
        with _lock:
            head = _cache.get(key)
            if head is None:
                opts = (
                    options.model_dump() if isinstance(options, BaseModel) else dict(options or {})
                )
                head = FusedHead(FusedHeadConfig(backend=backend, options=opts))
                _cache[key] = head
    return head


def clear_cache() -> None:
    """Forget resolved backends (after registry changes in tests or notebooks)."""
    _cache.clear()


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
) -> FusedHeadOutput:
    """Log-prob of each label and entropy of each row of ``hidden @ weight.T / temperature``.

    ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]``; outputs fp32 of the labels' shape.
    The backend is the one named, always; see DESIGN.md for the full contract.
    """
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str naming a backend, got {type(backend).__name__} {backend!r}"
        )
    if temperature is None:
        raise TypeError("temperature must be a float or a tensor, got None")
    head = get_fused_head(backend, options)
    return head(
        hidden,
        weight,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        process_group=process_group,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        reduce_hidden_grad=reduce_hidden_grad,
        check_labels=check_labels,
        softcap=softcap,
    )
