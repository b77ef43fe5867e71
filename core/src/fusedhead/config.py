"""``FusedHeadConfig``: which backend, its options and required capabilities, from dict/YAML/OmegaConf.

The backend's own options are validated against its ``Options`` model when the config is built, so
a typo in an option fails where the config is read, not on the first training step. Types are
strict everywhere (no bool or str where a number is expected, no str where a bool is), the same
rules ``fused_head`` applies to its arguments: a YAML ``temperature: yes`` is an error, not 1.0.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import numbers
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fusedhead.errors import BackendError, OptionsError, type_name
from fusedhead.options import (
    backend_error_inside,
    describe_type,
    option_rows,
    option_signature,
    option_signatures,
    plain_number,
    problems,
    validate_options,
)
from fusedhead.protocol import REQUIRABLE_CAPABILITIES, SCALAR_RANGE

__all__ = [
    "YAML_SECTION",
    "FusedHeadConfig",
    "OptionsError",
    "describe_type",
    "option_rows",
    "option_signature",
    "option_signatures",
    "validate_options",
]

#: The one key a YAML file may wrap the fields in (as a trainer's config file holds them).
YAML_SECTION = "fused_head"


def _clean_error(exc: ValidationError, *, arguments: bool = False) -> Exception:
    """pydantic's error on FusedHeadConfig as one line per field (no dumps, no links).

    ``arguments``: the fields came as a call's keyword arguments (``fused_head(backend=...)``,
    ``FusedHead(backend=...)``), so the message names arguments, not a FusedHeadConfig the caller
    never built.
    """
    inner = backend_error_inside(exc)
    if inner is not None:  # the backend's options: already names backend and options
        return inner
    what = "argument" if arguments else "field"
    phrases, _first, _expected, all_type = problems(exc, FusedHeadConfig, what)
    message = "; ".join(phrases)
    if not arguments and not message.startswith("FusedHeadConfig: "):  # model_validate runs
        message = "FusedHeadConfig: " + message  # __init__, whose error is cleaned already

    if any(p.startswith(f"unknown {what}") for p in phrases):
        message += f". {what.capitalize()}s: {', '.join(FusedHeadConfig.model_fields)}"
    if any(p.startswith(f"unknown {what} {YAML_SECTION!r}") for p in phrases):
        message += (
            f". The fields sit under {YAML_SECTION!r} in a trainer's config: pass that section "
            f"(from_dict(config[{YAML_SECTION!r}]), from_omegaconf(cfg.{YAML_SECTION}))"
        )
    return (TypeError if all_type else ValueError)(message)


# --- the config ---------------------------------------------------------------------------------

#: True while ``FusedHeadConfig.from_arguments`` builds a config from a call's keyword arguments
#: (pydantic runs the custom ``__init__`` on every validation, so the flag reaches it there).
_FROM_ARGUMENTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fusedhead_config_from_arguments", default=False
)


class FusedHeadConfig(BaseModel):
    """Configuration of a ``FusedHead``: the backend by exact name, its options, call defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    #: ``registry.resolve``'s answer for this config's backend and options (set by validation).
    _resolved: Any = PrivateAttr(default=None)

    backend: str = Field(
        "torch", description="Exact backend name (entry-point name); never chosen for you."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own options, validated strictly against its Options model.",
    )
    require: list[str] = Field(
        default_factory=list,
        description="Boolean capabilities the backend must declare (e.g. batch_invariant); checked, never used to pick.",
    )
    temperature: float = Field(
        1.0,
        description="Default temperature of calls that pass none; finite, > 0 (a backend's "
        "declared min_temperature is checked at the call: triton's is 1e-3, torch's 2**-100).",
    )
    ignore_index: int = Field(-100, description="Label value whose rows give 0 and no gradient.")
    return_entropy: bool = Field(True, description="Compute the entropy output by default.")
    check_labels: bool = Field(
        True,
        description="Validate the values of labels (their range), gather_ids, a per-token temperature tensor where given and, in a policy loss, its per-token old, reference and rollout log-probs and advantages (finite on scored rows) and a loss_normalizer tensor (a count); one device-to-host read for all of a call's value checks, on CUDA after the backend has queued its kernels; under torch.compile one op of the graph each, the same ValueError. False skips them all (no read: CUDA graphs), and a bad value then gives its row wrong values (NaN, inf, or a negative temperature's reversed ranking), never an out-of-bounds read.",
    )
    softcap: float | None = Field(
        None,
        description="Default logit softcap c: z = c * tanh(z / c) before the temperature division; finite, > 0.",
    )
    device: str | None = Field(
        None,
        description="Device on which `require` is checked at resolution (a torch device string: 'cpu', 'cuda', 'cuda:1'); default CUDA if present, else CPU. The config only parses it; resolving a head (FusedHead, FusedLMHead, fusedhead.api.cached_head) refuses one this process cannot use (CUDA absent, an index past the device count, an accelerator type torch has not here) with a ValueError.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _clean_error(exc, arguments=_FROM_ARGUMENTS.get()) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> FusedHeadConfig:
        """pydantic's entry point, with the same one-line errors as the constructor."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _clean_error(exc) from None

    def __hash__(self) -> int:
        """The hash of its settings (their JSON text), so a config can key a dict or a cache
        (pydantic's frozen hash fails on the options dict); equal configs hash equal."""
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=repr))

    @property
    def resolved(self) -> Any:
        """``registry.resolve``'s answer for this config, made while validating it (or None)."""
        return self._resolved

    @classmethod
    def from_arguments(cls, **arguments: Any) -> FusedHeadConfig:
        """The config a call's keyword arguments make (``get_fused_head(backend, options)``,
        ``FusedHead(**overrides)``): an error names the argument, not FusedHeadConfig."""
        token = _FROM_ARGUMENTS.set(True)
        try:
            return cls(**arguments)
        finally:
            _FROM_ARGUMENTS.reset(token)

    @field_validator("options", mode="before")
    @classmethod
    def _options_mapping(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and not isinstance(value, dict):
            return dict(value)
        return {} if value is None else value

    @field_validator("require", mode="before")
    @classmethod
    def _require_sequence(cls, value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    @field_validator("require")
    @classmethod
    def _known_capabilities(cls, value: list[str]) -> list[str]:
        unknown = [c for c in value if c not in REQUIRABLE_CAPABILITIES]
        if unknown:
            raise ValueError(
                f"names unknown capabilities {unknown}; known: {sorted(REQUIRABLE_CAPABILITIES)}"
            )
        return value

    @field_validator("temperature", "softcap", mode="before")
    @classmethod
    def _int_to_float(cls, value: Any, info: ValidationInfo) -> Any:
        # A number only: a tensor (a bool one included) would be read as its one value.
        if value is not None and not isinstance(value, (numbers.Real, str)):
            where = " (a per-token temperature is a call's argument)"
            raise ValueError(
                f"must be a float, got a {type_name(value)}"
                + (where if info.field_name == "temperature" else "")
            )
        # An int is a number here (not a bool); one beyond the float range is infinite.
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                return math.inf
        return value

    @field_validator("temperature", "softcap")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        # The range a call checks (protocol.SCALAR_RANGE): a config that builds is one that runs.
        if value is not None and not SCALAR_RANGE[0] <= value <= SCALAR_RANGE[1]:
            raise ValueError(
                "must be a finite float > 0 in [2**-126, 2**126] (about 1.2e-38 to 8.5e37: it and "
                "its reciprocal normal fp32 numbers)"
            )
        return value

    @field_validator("ignore_index", mode="before")
    @classmethod
    def _integer(cls, value: Any) -> Any:
        # A NumPy integer is the int it stands for, as in a call; a bool (NumPy's too) is not.
        return plain_number(value) if isinstance(value, numbers.Integral) else value

    @field_validator("ignore_index")
    @classmethod
    def _int64(cls, value: int) -> int:
        if not -(2**63) <= value < 2**63:
            raise ValueError("must fit in int64 (labels are int64)")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str | None) -> str | None:
        if value is None:
            return value
        import torch

        try:
            torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(
                "must be a torch device string such as 'cpu', 'cuda' or 'cuda:1'"
            ) from None
        return value

    @model_validator(mode="after")
    def _validate_backend_options(self) -> FusedHeadConfig:
        # The backend resolved once, here, into (entry, class, options): its options fail where
        # the config is read, and the head built from this config reuses the resolution.
        from fusedhead.registry import resolve

        resolved = resolve(self.backend, self.options)
        self._resolved = resolved
        dumped = resolved.options.model_dump(mode="json", exclude_unset=True)
        object.__setattr__(self, "options", dumped)
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusedHeadConfig:
        """Build from a plain mapping of the fields (as found in a trainer's config)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"config must be a mapping, got {type(data).__name__}")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise TypeError(f"config keys must be field names (str), got {bad[0]!r}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(
        cls, text: str | os.PathLike[str], *, source: str | None = None
    ) -> FusedHeadConfig:
        """Build from YAML text, or from a YAML file when given a path (``pathlib.Path``).

        The fields sit at the top, or under one ``fused_head:`` key (the shape of
        docs/configuration.md). Numbers are read by YAML 1.2's rules (``010`` is 10, ``1:30`` a
        str). A malformed file is a ``ValueError`` naming the file (``source``) and the line and
        column. Needs PyYAML (the core's ``yaml`` extra).
        """
        try:
            import yaml
        except ModuleNotFoundError as exc:
            from fusedhead.install_hints import extra_command

            raise ModuleNotFoundError(
                "FusedHeadConfig.from_yaml needs PyYAML, which is not installed: "
                f"{extra_command('yaml')} (the core's 'yaml' extra); or build the config with "
                "from_dict",
                name="yaml",
            ) from exc

        if isinstance(text, os.PathLike):
            source = source or os.fspath(text)
            try:
                text = Path(text).read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{source}: not a YAML text file (not UTF-8: byte {exc.object[exc.start]:#04x} "
                    f"at offset {exc.start})"
                ) from None
        elif not isinstance(text, str):
            raise TypeError(f"text must be YAML text (str) or a path, got {type(text).__name__}")
        where = source or "<yaml text>"
        try:
            data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            context = getattr(exc, "context", None)
            raise ValueError(
                f"{where}: not valid YAML{at}: {problem}" + (f" ({context})" if context else "")
            ) from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            path_like = isinstance(data, str) and data.endswith((".yaml", ".yml", ".json"))
            raise TypeError(
                f"{where}: a fusedhead config is a mapping of fields (or one {YAML_SECTION!r} key "
                f"holding them), got a YAML {type(data).__name__}"
                + (
                    f"; from_yaml reads a str as YAML text: to read the file {data!r}, pass "
                    f"pathlib.Path({data!r})"
                    if path_like
                    else ""
                )
            )
        if YAML_SECTION in data:
            others = sorted(str(k) for k in data if k != YAML_SECTION)
            if others:
                raise ValueError(
                    f"{where}: holds {YAML_SECTION!r} beside other keys {others}: give the "
                    f"{YAML_SECTION!r} section alone, or the fields at the top"
                )
            data = data[YAML_SECTION] if data[YAML_SECTION] is not None else {}
            if not isinstance(data, dict):
                raise TypeError(
                    f"{where}: {YAML_SECTION!r} must hold a mapping of fields, got a YAML "
                    f"{type(data).__name__}"
                )
        try:
            return cls.from_dict(data)
        except BackendError as exc:  # its message is built from fields: the file joins the reason
            if source is not None:
                exc.reason = f"{where}: {exc.reason}"
            raise
        except (ValueError, TypeError) as exc:
            if source is None:
                raise
            raise type(exc)(f"{where}: {exc}") from None

    @classmethod
    def from_omegaconf(cls, node: Any) -> FusedHeadConfig:
        """Build from an OmegaConf/Hydra ``DictConfig`` node (interpolations resolved; a value
        still OmegaConf's missing ``???`` is refused by its key, not read as the text "???")."""
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            missing = sorted(OmegaConf.missing_keys(node))
            if missing:
                raise ValueError(
                    f"FusedHeadConfig: {', '.join(missing)}: OmegaConf's missing value '???', "
                    "not a value: set it, or drop the key for its default"
                )
        data = OmegaConf.to_container(node, resolve=True)
        if not isinstance(data, dict):
            raise TypeError(f"config node must be a mapping, got {type(data).__name__}")
        return cls.from_dict({str(k): v for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` turns back into an equal config."""
        return self.model_dump(mode="json")


#: YAML 1.2 core-schema ints: decimal (``010`` is 10, not YAML 1.1's octal 8), ``0o`` octal,
#: ``0x`` hex; ``0b`` binary and ``_`` between digits are kept from YAML 1.1, which read them alike.
#: No base 60: YAML 1.1 read ``1:30`` as 90, YAML 1.2 as the str the config then refuses.
_YAML_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|[-+]?0o[0-7_]+|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[01_]+)$")
#: YAML 1.2 core-schema floats: a dot or an exponent (``1e-3``, ``1.e-3``, ``.5``, which YAML 1.1
#: read as str but for the last), ``.inf``, ``.nan``; ``_`` between digits kept; no base 60
#: (YAML 1.1 read ``1:30.5`` as 90.5).
_YAML_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_YAML_INT_TAG = "tag:yaml.org,2002:int"
_YAML_FLOAT_TAG = "tag:yaml.org,2002:float"


def _yaml_int(loader: Any, node: Any) -> int:
    """A YAML 1.2 int's value: a leading 0 is decimal (YAML 1.1's constructor read it as octal)."""
    import yaml

    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text[:1] == "-" else 1
    digits = text.lstrip("+-")
    base = {"0o": 8, "0x": 16, "0b": 2}.get(digits[:2], 10)
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:  # an explicit !!int tag on what is not one
        raise yaml.constructor.ConstructorError(
            None, None, f"expected an integer, got {text!r}", node.start_mark
        ) from None


@functools.cache
def _yaml_loader() -> type:
    """PyYAML's SafeLoader with YAML 1.2's ints and floats (core schema) in place of YAML 1.1's:
    ``010`` is 10 (not octal 8), ``1:30`` a str (not base-60 90), ``1e-3`` a float (not a str),
    what a YAML 1.2 reader gives; a misread number would pass validation silently."""
    import yaml

    class Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types here
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            """A mapping whose key repeats is refused (PyYAML keeps the last one silently: a
            file saying ``backend:`` twice ran the second without a word)."""
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    break
                if first is not key_node:
                    line = key_node.start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"found the key {key!r} twice (first at line {first.start_mark.line + 1}, "
                        f"again at line {line}); give each key once",
                        key_node.start_mark,
                    )
            return super().construct_mapping(node, deep=deep)

    Loader.yaml_implicit_resolvers = {  # YAML 1.1's int and float rules dropped, the rest kept
        first: [(tag, rule) for tag, rule in rules if tag not in (_YAML_INT_TAG, _YAML_FLOAT_TAG)]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(_YAML_INT_TAG, _YAML_INT, list("-+0123456789"))
    Loader.add_implicit_resolver(_YAML_FLOAT_TAG, _YAML_FLOAT, list("-+0123456789."))
    Loader.add_constructor(_YAML_INT_TAG, _yaml_int)
    return Loader
