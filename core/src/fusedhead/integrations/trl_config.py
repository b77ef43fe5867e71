"""TRL: the head a trainer config names (``fused_head_backend``, ``fused_head_options``, or the
trainer's ``fused_head=`` keyword) and the device it will run on, read before the trainer is built.

Shared by the fused LM head (:mod:`fusedhead.integrations.trl`) and the fused GRPO loss
(:mod:`fusedhead.integrations.trl_policy_loss`). TRL is imported only by ``trl_utils``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from typing import Any

import torch

from fusedhead.api import FusedHead
from fusedhead.errors import OptionsError
from fusedhead.integrations.backend_spec import (
    HeadLike,
    check_head_runs_on,
    is_fusedhead_spec,
    parse_backend_spec,
    resolve_lm_head,
)
from fusedhead.options import load_json

__all__ = [
    "BACKEND_FIELD",
    "BACKEND_KEYWORD",
    "TESTED_TRL",
    "check_args_device",
    "config_argument",
    "fused_head_from_args",
    "resolve_named",
    "trainer_device",
    "trl_utils",
]

#: TRL versions fusedhead.integrations.trl was tested against.
TESTED_TRL = ">=1.16.0,<1.17"


def trl_utils() -> types.ModuleType:
    """``trl.trainer.utils``, imported here on first use; an ImportError names the TRL tested."""
    try:
        import trl.trainer.utils as utils
    except ImportError as exc:
        raise ImportError(
            f"fusedhead.integrations.trl needs TRL ({TESTED_TRL} tested): pip install 'trl{TESTED_TRL}' "
            f"({exc})"
        ) from exc
    module: types.ModuleType = utils  # Any where TRL is not installed (mypy without the trainers)
    return module


def fused_head_from_args(args: Any) -> HeadLike:
    """The head named by a trainer config's ``fused_head_backend`` / ``fused_head_options``.

    ``fused_head_backend`` is a backend name (``"triton"``) or ``"fusedhead:<name>"``;
    ``fused_head_options`` a mapping or its JSON text (the backend's own options).
    """
    name = getattr(args, "fused_head_backend", None)
    if name is None and hasattr(args, "fused_head_backend"):
        raise ValueError(
            f"{type(args).__name__}(fused_head_backend=None): name the backend, e.g. "
            "fused_head_backend='fusedhead:triton' ('fusedhead list' shows those installed), or "
            "pass fused_head='triton' (a backend name) to the trainer"
        )
    if name is None:
        raise ValueError(
            f"{type(args).__name__} has no fused_head_backend: use fusedhead's config class for "
            "the trainer (FusedHeadGRPOConfig, FusedHeadRLOOConfig, FusedHeadSFTConfig, "
            "FusedHeadDPOConfig, FusedHeadKTOConfig), or pass fused_head='triton' (a backend "
            "name) to the trainer"
        )
    options = getattr(args, "fused_head_options", None)
    if isinstance(options, str):
        try:
            options = load_json(options)
        except ValueError as exc:  # malformed, or a key given twice
            raise ValueError(f"fused_head_options is not valid JSON: {options!r} ({exc})") from None
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"fused_head_options must be a mapping or JSON text, got {type(options).__name__}"
        )
    if not options:
        return str(name)
    spec = str(name)
    backend = parse_backend_spec(spec, setting=BACKEND_FIELD) if is_fusedhead_spec(spec) else spec
    return {"backend": backend, "options": dict(options)}


#: The config field and the trainer keyword that name the backend.
BACKEND_FIELD, BACKEND_KEYWORD = "fused_head_backend", "fused_head"


def _named_by(args: Any, fused_head: HeadLike) -> tuple[HeadLike, str, object]:
    """``(head, setting, value)``: what names the backend (the ``fused_head=`` keyword, else the
    config's ``fused_head_backend``), that setting's name and its value as the user wrote it."""
    if fused_head is not None:
        shown = fused_head.name if isinstance(fused_head, FusedHead) else fused_head
        return fused_head, BACKEND_KEYWORD, shown
    return fused_head_from_args(args), BACKEND_FIELD, getattr(args, BACKEND_FIELD, None)


def _options_via(setting: str) -> str:
    """How a backend's options are passed beside ``setting``."""
    if setting == BACKEND_KEYWORD:
        return "fused_head={'backend': '<name>', 'options': {...}} (a mapping)"
    return 'fused_head_options (JSON text, e.g. fused_head_options=\'{"key": "value"}\')'


def resolve_named(args: Any, fused_head: HeadLike = None) -> tuple[FusedHead, str, object]:
    """The head the trainer keyword ``fused_head`` (else ``args.fused_head_backend``) names,
    resolved; an unknown or malformed name is reported as that setting's value. Returns
    ``(head, setting, value)``."""
    head, setting, value = _named_by(args, fused_head)
    try:
        return resolve_lm_head(head, setting=setting, value=value), setting, value
    except OptionsError as exc:
        if setting != BACKEND_FIELD:
            raise
        # the options came from the config's fused_head_options: name that setting too
        exc.reason = (
            f"fused_head_options={getattr(args, 'fused_head_options', None)!r}: {exc.reason}"
        )
        raise


def trainer_device(args: Any) -> tuple[torch.device, torch.dtype | None]:
    """Where a TRL config's heads will run: (device, dtype), read without building the trainer.

    The CPU under ``use_cpu`` or without CUDA, else CUDA; bf16 / fp16 under ``bf16`` / ``fp16``
    unless ``cast_lm_head_to_fp32``, else None (the model's own dtype: the device alone is checked).
    """
    device = torch.device(
        "cpu" if getattr(args, "use_cpu", False) or not torch.cuda.is_available() else "cuda"
    )
    dtype: torch.dtype | None = None
    if not getattr(args, "cast_lm_head_to_fp32", False):
        if getattr(args, "bf16", False):
            dtype = torch.bfloat16
        elif getattr(args, "fp16", False):
            dtype = torch.float16
    return device, dtype


def check_args_device(
    args: Any, head: HeadLike = None, *, setting: str | None = None, value: object = None
) -> FusedHead:
    """Resolve the head ``args`` (or ``head``) names and check it runs where ``args`` trains.

    Raised when a FusedHead*Config or trainer is built, before any model is loaded:
    ``BackendUnavailableError`` naming the setting that named the backend (``setting``, default
    ``fused_head_backend``; the trainer's ``fused_head=`` keyword is ``fused_head``), its
    ``value`` as written, the device and the fix.
    """
    if head is None:
        fused, setting, value = resolve_named(args)
    else:
        setting = setting or BACKEND_FIELD
        fused = resolve_lm_head(head, setting=setting, value=value)
    device, dtype = trainer_device(args)
    check_head_runs_on(
        fused,
        device,
        dtype,
        setting=setting,
        value=fused.name if value is None else value,
        options_via=_options_via(setting),
    )
    return fused


def config_argument(
    trainer: object, mixin: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """The config (``args``) that ``mixin.__init__`` on ``trainer`` is passing on, however given.

    The call is bound to the first ``__init__`` after ``mixin`` in the trainer's MRO that names its
    parameters (TRL's trainer: fusedhead's mixins and TRL's ``_BaseTrainer`` take ``*args``, under
    which a keyword ``args=`` would be read as the positional tuple). None when there is none.
    """
    mro = type(trainer).__mro__
    for cls in mro[mro.index(mixin) + 1 :]:
        init = vars(cls).get("__init__")
        if init is None:
            continue
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        param = signature.parameters.get("args")
        if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        try:
            return signature.bind_partial(trainer, *args, **kwargs).arguments.get("args")
        except TypeError:  # the call does not fit: TRL's own __init__ will say so
            break
    return kwargs.get("args")
