"""``FusedHeadConfig``: which backend, its options and required capabilities, from dict/YAML/OmegaConf.

The backend's own options are validated against its ``Options`` model when the config is built, so
a typo in an option fails where the config is read, not on the first training step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fusedhead.protocol import REQUIRABLE_CAPABILITIES


class FusedHeadConfig(BaseModel):
    """Configuration of a ``FusedHead``: the backend by exact name, its options, call defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(
        "torch", description="Exact backend name (entry-point name); never chosen for you."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The backend's own options, validated against its Options model.",
    )
    require: list[str] = Field(
        default_factory=list,
        description="Boolean capabilities the backend must declare (e.g. batch_invariant); checked, never used to pick.",
    )
    temperature: float = Field(
        1.0, description="Default temperature of calls that pass none; finite, > 0."
    )
    ignore_index: int = Field(-100, description="Label value whose rows give 0 and no gradient.")
    return_entropy: bool = Field(True, description="Compute the entropy output by default.")
    check_labels: bool = Field(
        True,
        description="Validate the label range (one device-to-host sync); False for CUDA graphs / torch.compile.",
    )
    softcap: float | None = Field(
        None,
        description="Default logit softcap c: z = c * tanh(z / c) before the temperature division.",
    )
    device: str | None = Field(
        None,
        description="Device on which `require` is checked at resolution; default CUDA if present, else CPU.",
    )

    @field_validator("require")
    @classmethod
    def _known_capabilities(cls, value: list[str]) -> list[str]:
        unknown = [c for c in value if c not in REQUIRABLE_CAPABILITIES]
        if unknown:
            raise ValueError(
                f"require names unknown capabilities {unknown}; known: {sorted(REQUIRABLE_CAPABILITIES)}"
            )
        return value

    @field_validator("temperature", "softcap")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"must be a finite float > 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _validate_backend_options(self) -> FusedHeadConfig:
        from fusedhead.registry import load_class

        cls = load_class(self.backend)
        normalized = validate_options(self.backend, cls, self.options)
        object.__setattr__(self, "options", normalized.model_dump(mode="json", exclude_unset=True))
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusedHeadConfig:
        """Build from a plain mapping (as found in a trainer's config)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"config must be a mapping, got {type(data).__name__}")
        return cls.model_validate(dict(data))

    @classmethod
    def from_yaml(cls, text: str) -> FusedHeadConfig:
        """Build from YAML text (needs PyYAML: ``pip install fusedhead[yaml]``)."""
        import yaml

        data = yaml.safe_load(text)
        return cls.from_dict(data or {})

    @classmethod
    def from_omegaconf(cls, node: Any) -> FusedHeadConfig:
        """Build from an OmegaConf/Hydra ``DictConfig`` node (interpolations resolved)."""
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(node, resolve=True)
        if not isinstance(data, dict):
            raise TypeError(f"config node must be a mapping, got {type(data).__name__}")
        return cls.from_dict({str(k): v for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` turns back into an equal config."""
        return self.model_dump(mode="json")


def validate_options(name: str, cls: type, options: Any) -> BaseModel:
    """The backend's ``Options`` instance for ``options`` (a mapping, an Options instance or None)."""
    model: type[BaseModel] = cls.Options  # type: ignore[attr-defined]
    if options is None:
        options = {}
    if isinstance(options, model):
        return options
    if isinstance(options, BaseModel):
        options = options.model_dump()
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options for backend {name!r} must be a mapping, got {type(options).__name__}"
        )
    try:
        return model.model_validate(dict(options))
    except ValueError as exc:
        raise ValueError(f"options for backend {name!r} are not valid: {exc}") from exc
