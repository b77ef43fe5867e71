"""An in-process reference backend for contract tests of the core, independent of any plugin."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from fusedhead import registry
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput
from fusedhead.reference import reference_fused_head


class RefOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    tag: str = "x"


class RefBackend:
    """Full fp32 logits; records every forward call so tests can see what the core passed."""

    name: ClassVar[str] = "ref-test"
    Options: ClassVar[type[BaseModel]] = RefOptions
    plugin_api_version: ClassVar[int] = 2
    calls: ClassVar[list[dict[str, Any]]] = []
    caps: ClassVar[dict[str, Any]] = {}

    def __init__(self, options: RefOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(devices=("cpu", "meta"), **self.caps)

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def forward(self, call: HeadCall) -> HeadOutput:
        self.calls.append({**call._asdict(), "return_entropy": call.return_entropy})
        lp, ent = reference_fused_head(
            call.hidden,
            call.weight,
            call.labels,
            temperature=call.temperature,
            ignore_index=call.ignore_index,
            return_entropy=call.return_entropy,
            softcap=call.softcap,
            compute_dtype=torch.float32,
        )
        return HeadOutput(lp, ent)


@pytest.fixture
def ref_backend() -> Iterator[type[RefBackend]]:
    RefBackend.calls.clear()
    RefBackend.caps = {}
    registry.register_backend("ref-test", RefBackend, replace=True)
    registry.refresh()
    yield RefBackend
    registry.unregister_backend("ref-test")
    registry.refresh()


#: ``variant(name, **attributes)``: see the ``variant`` fixture.
Variant = Callable[..., type]


@pytest.fixture
def variant(ref_backend: type[RefBackend]) -> Iterator[Variant]:
    """A factory: the reference backend under another name with other class attributes
    (``Options=...``, ``capabilities=...``), registered in-process, unregistered after the test."""
    made: list[str] = []

    def make(name: str, **attributes: Any) -> type:
        cls = type(name.title().replace("-", ""), (ref_backend,), {"name": name, **attributes})
        registry.register_backend(name, cls, replace=True)
        registry.refresh()
        made.append(name)
        return cls

    yield make
    for name in made:
        registry.unregister_backend(name)
    registry.refresh()


def make_inputs(
    n: int = 6, h: int = 8, v: int = 11, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float32).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


@pytest.fixture
def inputs() -> Any:
    """The input factory ``make_inputs(n, h, v, dtype, seed)``."""
    return make_inputs
