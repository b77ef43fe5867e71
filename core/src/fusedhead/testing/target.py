"""The thing under test: a backend by name, with options, on a device and an input dtype."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from fusedhead.api import FusedHead
from fusedhead.errors import BackendUnavailableError
from fusedhead.options import load_json
from fusedhead.protocol import Capabilities
from fusedhead.testing.tolerances import Tolerances

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    """Problem sizes (N, H, V) for a device: small on the CPU, bigger on a GPU."""

    main: tuple[int, int, int]  # powers of two, so a tile-size bug shows up only in ``odd``
    odd: tuple[tuple[int, int, int], ...]  # V and H multiples of no tile
    small: tuple[int, int, int]  # for properties that sweep many settings
    examples: int  # hypothesis examples


CPU_SIZES = Sizes(
    main=(128, 128, 1024), odd=((37, 103, 1037), (5, 3, 5)), small=(48, 64, 512), examples=30
)
GPU_SIZES = Sizes(
    main=(1024, 1024, 8192),
    odd=((1037, 1027, 4099), (37, 103, 1037), (5, 3, 5)),
    small=(256, 256, 2048),
    examples=60,
)


def parse_options(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Backend options from a JSON object string, a mapping or None."""
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    value = load_json(text)
    if not isinstance(value, dict):
        raise ValueError(f"--options must be a JSON object, got {text!r}")
    return value


@dataclass
class Target:
    """A resolved backend that runs on ``device`` with ``dtype`` inputs (else resolve() raises)."""

    backend: str
    options: dict[str, Any]
    device: torch.device
    dtype_name: str
    head: FusedHead = field(repr=False)
    caps: Capabilities = field(repr=False)

    @classmethod
    def resolve(
        cls,
        backend: str,
        options: Mapping[str, Any] | str | None = None,
        device: str | torch.device = "cpu",
        dtype: str = "fp32",
    ) -> Target:
        """Resolve ``backend`` like a user would; raise ``BackendUnavailableError`` if it cannot run here."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        opts = parse_options(options)
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "--device cuda was asked for but torch sees no CUDA device here"
            )
        head = FusedHead(backend=backend, options=opts, device=str(dev))  # errors name arguments
        # As a call's first use of (device, dtype) does: the backend's check() first (its own
        # reason and fix reach the user; a raw exception from it is a BackendContractError naming
        # the distribution), then its declared devices and dtypes.
        caps = head.ready(dev, DTYPES[dtype])
        return cls(backend, opts, dev, dtype, head, caps)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    def unchecked_head(self, ignore_index: int | None = None) -> FusedHead:
        """The same backend with ``check_labels=False``: no value read, so a policy-loss call
        hands the backend every row, ignored ones included (a checked call leaves them out);
        ``ignore_index``: the head's, where not the default."""
        return FusedHead(
            backend=self.backend,
            options=self.options,
            device=str(self.device),
            check_labels=False,
            ignore_index=-100 if ignore_index is None else ignore_index,
        )

    @property
    def min_temperature(self) -> float:
        """The smallest temperature the backend declares it computes at (``Capabilities``)."""
        return float(self.caps.min_temperature)

    @overload
    def allowed_temperature(self, temperature: float) -> float: ...
    @overload
    def allowed_temperature(self, temperature: torch.Tensor) -> torch.Tensor: ...
    def allowed_temperature(self, temperature: float | torch.Tensor) -> float | torch.Tensor:
        """``temperature`` raised to the declared ``min_temperature`` where it is below it (each
        value of a per-token tensor): the kit tests what the backend declares it computes."""
        floor = self.min_temperature
        if isinstance(temperature, torch.Tensor):
            if bool((temperature < floor).any()):
                return temperature.clamp(min=floor)
            return temperature
        return max(float(temperature), floor)

    def temperature_range(self, low: float, high: float) -> tuple[float, float]:
        """``(low, high)`` within what the backend declares: both at least ``min_temperature``."""
        return self.allowed_temperature(low), self.allowed_temperature(high)

    @property
    def sizes(self) -> Sizes:
        return CPU_SIZES if self.device.type == "cpu" else GPU_SIZES

    def describe(self) -> str:
        opts = f" options={json.dumps(self.options, sort_keys=True)}" if self.options else ""
        return f"{self.backend} on {self.device} {self.dtype_name}{opts}"

    def tolerances(self, h: int, v: int, zmax: float) -> Tolerances:
        """The tolerance table for this target's dtype and declared precisions."""
        return Tolerances.for_case(
            dtype=self.dtype_name,
            logits_precision=self.caps.logits_precision,
            entropy_precision=self.caps.entropy_precision,
            h=h,
            v=v,
            zmax=zmax,
        )

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kw: Any
    ) -> Any:
        """Call the backend through the public contract (the core validates and reshapes)."""
        return self.head(hidden, weight, labels, **kw)
