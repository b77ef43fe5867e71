"""Which backend a trainer's setting names: the ``"fusedhead"`` / ``"fusedhead:<name>"``
spellings of trainer configs, a name, config or mapping resolved to a ``FusedHead``, and the check
that it runs on the trainer's device and dtype, with errors that name the setting as the user
wrote it.

Shared by every trainer's glue (:mod:`fusedhead.integrations.lm_head` and the trainers' modules).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from fusedhead.api import FusedHead, cached_head
from fusedhead.checks import device_arg, did_you_mean, dtype_name
from fusedhead.config import FusedHeadConfig
from fusedhead.module import FusedLMHead
from fusedhead.registry import NAME_PATTERN

__all__ = [
    "DEFAULT_BACKEND",
    "SPEC_PREFIX",
    "HeadLike",
    "check_head_runs_on",
    "installed_backend_names",
    "is_fusedhead_spec",
    "is_misspelt_spec",
    "parse_backend_spec",
    "refuse_decided_settings",
    "resolve_lm_head",
    "spelled",
]

#: What ``head=`` accepts: a resolved head, a config, a plain mapping, a backend name or None.
HeadLike = FusedHead | FusedHeadConfig | Mapping[str, Any] | str | None

#: The prefix that marks a trainer-config value as meant for fusedhead.
SPEC_PREFIX = "fusedhead"

#: The backend ``"fusedhead"`` (no ``:<name>``) stands for: ``FusedHeadConfig``'s own default.
DEFAULT_BACKEND: str = FusedHeadConfig.model_fields["backend"].default

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ACCEPTED = "'fusedhead' (the default backend, 'torch') or 'fusedhead:<backend name>', e.g. 'fusedhead:triton'"


def is_fusedhead_spec(value: object) -> bool:
    """True when a trainer-config value is meant for fusedhead (it starts with ``fusedhead``).

    Case and surrounding spaces are ignored here on purpose: ``"FusedHead:triton"`` is claimed
    by fusedhead so that :func:`parse_backend_spec` rejects it loudly instead of the trainer
    treating it as one of its own names.
    """
    return isinstance(value, str) and value.strip().lower().startswith(SPEC_PREFIX)


def is_misspelt_spec(value: object, trainer_names: Iterable[str] = ()) -> bool:
    """A trainer-config value meant for fusedhead that is not its spelling (``fusedhaed:triton``,
    ``fused-head``), and not one of the trainer's own ``trainer_names``. Only such a value is
    refused by the integrations: any other stays the trainer's to handle, as without fusedhead."""
    if not isinstance(value, str) or value in trainer_names or is_fusedhead_spec(value):
        return False
    word = value.partition(":")[0].strip().lower().replace("-", "").replace("_", "")
    return bool(difflib.get_close_matches(word, [SPEC_PREFIX], n=1, cutoff=0.75))


def parse_backend_spec(spec: object, *, setting: str | None = None) -> str:
    """The backend name in a trainer-config spelling: ``"fusedhead:triton"`` -> ``"triton"``.

    ``"fusedhead"`` alone means the default backend (``"torch"``). Anything else, a plain
    ``"triton"``, ``"FusedHead:triton"``, ``"fusedhead:"`` or ``"fusedhead-triton"``, is a
    ValueError naming the value and the accepted forms; with ``setting`` (the trainer's config
    entry that holds the value) the error names that entry, as the user wrote it. Whether the name
    is installed is the registry's question, asked when the head is resolved
    (``UnknownBackendError`` lists them).
    """
    what = "backend spec" if setting is None else setting
    if not isinstance(spec, str):
        raise TypeError(
            f"{what} must be a str such as {_ACCEPTED}, got {type(spec).__name__} {spec!r}"
        )
    if spec == SPEC_PREFIX:
        return DEFAULT_BACKEND
    prefix, sep, name = spec.partition(":")
    if prefix != SPEC_PREFIX or not sep or not _NAME.fullmatch(name):
        shown = f"backend spec {spec!r}" if setting is None else f"{setting}={spec!r}"
        raise ValueError(f"{shown} is not one of the accepted forms: {_ACCEPTED}")
    return name


def spelled(name: str, like: object) -> str:
    """Backend ``name`` as a trainer setting holding ``like`` spells it: ``'fusedhead:<name>'``
    where ``like`` is a fusedhead spec, else the bare name."""
    return repr(f"{SPEC_PREFIX}:{name}" if is_fusedhead_spec(like) else name)


def installed_backend_names() -> list[str]:
    """The installed backends' names, from metadata (nothing is imported)."""
    from fusedhead import diagnostics

    return sorted({row.name for row in diagnostics.listing()})


def resolve_lm_head(
    head: HeadLike,
    lm_head: nn.Module | None = None,
    *,
    setting: str | None = None,
    value: object = None,
) -> FusedHead:
    """The ``FusedHead`` that ``head`` names, resolved once per distinct configuration.

    A string is a backend name (``"triton"``) or a trainer spelling (``"fusedhead:triton"``);
    a mapping or ``FusedHeadConfig`` is a full config; a ``FusedHead`` is used as is. With
    ``head=None`` a ``FusedLMHead`` keeps its own head, anything else gets the default config.
    Resolutions go through the core's one cache (``fusedhead.api.cached_head``, cleared by
    ``fusedhead.refresh()``), so the provenance hook fires once per configuration. ``setting``:
    the trainer's config entry (or argument) that holds ``head``; a malformed spelling and an
    unknown backend name are then reported as that entry's value, as the user wrote it, with the
    installed names in the same spelling. ``value``: what the user wrote in ``setting``, where
    ``head`` was built from it (default ``head`` itself).
    """
    from fusedhead.errors import UnknownBackendError

    shown = head if value is None else value

    if isinstance(head, FusedHead):
        return head
    if head is None and isinstance(lm_head, FusedLMHead):
        return lm_head.head
    try:
        if head is None or isinstance(head, (FusedHeadConfig, Mapping)):
            return cached_head(head)
        if isinstance(head, str):
            name = parse_backend_spec(head, setting=setting) if is_fusedhead_spec(head) else head
            if setting is not None and not NAME_PATTERN.match(name):
                _malformed_name(setting, shown)
            return cached_head({"backend": name})
    except UnknownBackendError as exc:
        if setting is None:
            raise
        names = ", ".join(spelled(n, shown) for n in installed_backend_names()) or "none"
        raise UnknownBackendError(
            f"{setting}={shown!r} names no installed fusedhead backend: {exc.reason}",
            backend=exc.backend,
            hint=f"set {setting} to one of {names}" + (f"; {exc.hint}" if exc.hint else ""),
        ) from None
    what = "head" if setting is None else setting
    raise TypeError(
        f"{what} must be a FusedHead, a FusedHeadConfig, a mapping, a backend name (str) or "
        f"None, got {type(head).__name__} {head!r}"
    )


def refuse_decided_settings(head: FusedHead, setting: str, decided_by: Mapping[str, str]) -> None:
    """Refuse a head whose config sets what the trainer's own call decides (``decided_by``: each
    such setting and who decides it, e.g. the trainer's sampling temperature): the call passes its
    own value, so the config's would be ignored, or would change the policy the trainer sampled."""
    cfg = head.config
    for name, owner in decided_by.items():
        value, default = getattr(cfg, name), FusedHeadConfig.model_fields[name].default
        if value != default:
            raise ValueError(
                f"{setting} sets {name}={value!r}, but {owner} decides it, not the head's config: "
                f"drop {name} from the config (it would be ignored, or change what is scored)"
            )


def _malformed_name(setting: str, shown: object) -> NoReturn:
    """A trainer setting's backend name that no backend can have (not ``[a-z0-9_-]+``, bare or
    after ``fusedhead:``), named as written, with the installed names in its spelling and the
    closest of them (a misspelt ``fusedhead:`` prefix or a capital included)."""
    names = [n for b in installed_backend_names() for n in (b, f"{SPEC_PREFIX}:{b}")]
    hint = did_you_mean(shown, names)
    listed = ", ".join(spelled(n, shown) for n in installed_backend_names()) or "none"
    raise ValueError(
        f"{setting}={shown!r} is not a backend name (a lowercase [a-z0-9_-]+ name, or "
        f"{SPEC_PREFIX}:<name>): set {setting} to one of {listed}{hint}"
    )


def lacks_policy_loss(head: FusedHead, reason: str, hint: str) -> Exception:
    """The ``CapabilityError`` a trainer's setting gets for a backend that does not declare
    ``policy_loss``, carrying the backend's identity."""
    from fusedhead.errors import CapabilityError

    return CapabilityError(
        reason,
        capability="policy_loss",
        hint=hint,
        backend=head.name,
        distribution=head.distribution,
        version=head.version,
    )


#: A backend's own advice in fusedhead's Python terms (``options={...}``, ``backend="torch"``),
#: which a trainer's setting may not be able to express.
_API_ADVICE = re.compile(r"\b(options|backend)\s*=")


def check_head_runs_on(
    head: FusedHead,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    setting: str,
    value: object = None,
    options_via: str | None = None,
) -> None:
    """Fail fast where a trainer is configured: ``head`` must run on ``device`` (and ``dtype``).

    Called when a trainer's config or model is built, so that a backend which cannot run there
    (``triton`` on a machine without CUDA) is refused before a model is loaded or a batch is
    generated. ``setting`` is the config entry that named it and ``value`` what the user wrote
    there (echoed as written; default the backend's name). ``dtype``: the dtype the head will
    compute in, where the trainer knows it; with None the device alone is checked: the backend
    passes if it runs there in any dtype it declares, and a refusal says the dtype was not known
    (the dtype in the backend's own reason is then the one it was probed with). ``options_via``:
    how that trainer passes a backend's options (None: its setting passes only the name); said
    where the backend's own advice is in fusedhead's Python terms (``options={...}``). Raises
    ``BackendUnavailableError`` naming the setting, its value, the device (and dtype) and fixes
    expressible in that setting: the installed backends that run on the device.
    """
    from fusedhead.errors import BackendUnavailableError

    dev = device_arg("device", device)
    identity = {"backend": head.name, "distribution": head.distribution, "version": head.version}
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    shown = head.name if value is None else value
    probes: list[torch.dtype] = [] if dtype is None else [dtype]
    declared: list[str] = []
    try:
        caps = head.capabilities(dev)
        declared = list(caps.dtypes)
        if dtype is None:  # fp32 first, then the rest it declares
            probes = [names[d] for d in sorted(declared, key=lambda d: d != "fp32")]
        failures: list[BackendUnavailableError] = []
        for probe in probes:
            try:
                head.backend.check(dev, probe)  # its message carries the reason and the fix
            except BackendUnavailableError as exc:
                failures.append(exc)
                continue
            break
        if len(failures) == len(probes) and failures:
            raise failures[0]
        if dev.type not in caps.devices:
            raise BackendUnavailableError(
                f"it declares devices {list(caps.devices)}, not {dev.type!r}", **identity
            )
        if dtype is not None and dtype_name(dtype) not in caps.dtypes:
            raise BackendUnavailableError(
                f"it declares dtypes {list(caps.dtypes)} on {dev.type}, not {dtype}", **identity
            )
    except BackendUnavailableError as exc:
        if dtype is not None:
            where = f"{dev.type} with {dtype}"
        elif len(probes) == 1:
            where = (
                f"{dev.type}; the dtype is not known here, so it was checked with "
                f"{probes[0]}, the only dtype it declares"
            )
        elif probes:
            where = f"{dev.type}, in any of the dtypes it declares {declared}"
        else:
            where = dev.type
        reason = exc.reason + (f" (its fix: {exc.hint})" if exc.hint else "")
        raise BackendUnavailableError(
            f"{setting}={shown!r} cannot run on this trainer's device ({where}): {reason}",
            hint=_runs_on_fix(head, dev, setting, shown, reason, options_via),
            **identity,
        ) from None


def _runs_on_fix(
    head: FusedHead,
    dev: torch.device,
    setting: str,
    value: object,
    reason: str,
    options_via: str | None,
) -> str:
    """The fix for :func:`check_head_runs_on`, in the trainer setting's own terms."""
    from fusedhead import diagnostics
    from fusedhead.diagnostics import Status

    rows = diagnostics.listing(probe=True, device=dev)
    ok = [spelled(r.name, value) for r in rows if r.status == Status.OK and r.name != head.name]
    fix = (
        f"set {setting} to a backend that runs on {dev.type} here: {', '.join(ok)}"
        if ok
        else f"no other installed fusedhead backend runs on {dev.type} here"
    )
    if _API_ADVICE.search(reason):
        how = (
            f"here a backend's options go in {options_via}"
            if options_via
            else f"{setting} takes a backend's name only, not its options"
        )
        fix += f" (the backend's own advice above is in fusedhead's Python terms; {how})"
    return fix
