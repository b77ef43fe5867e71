"""The plugin API: what a backend distribution implements, and the capabilities it declares.

A backend is a class registered under the entry-point group ``fusedhead.backends``; the entry-point
name is the backend name. The core validates every call before a backend sees it, so ``forward``
receives 2-D ``hidden [N, H]``, ``weight [V_local, H]`` of the same dtype and device, 1-D int64
``labels [N]``, and resolved ``vocab_start``/``vocab_size`` integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

#: Version of the plugin API this core speaks. A backend declares ``plugin_api_version``.
PLUGIN_API_VERSION = 1
#: Inclusive window of plugin API versions this core can load.
SUPPORTED_PLUGIN_API = (1, 1)

Precision = Literal["fp32", "fp16", "bf16"]
DTypeName = Literal["fp32", "fp16", "bf16"]


class Capabilities(BaseModel):
    """What a backend can do on one device; checked against ``require=[...]`` and the call."""

    model_config = ConfigDict(extra="allow", frozen=True)

    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[DTypeName, ...] = ("fp32", "fp16", "bf16")
    vocab_parallel: bool = False
    #: Forward and backward give the same bits run to run.
    deterministic: bool = False
    #: A row's forward outputs do not depend on the other rows of the batch or on N.
    batch_invariant: bool = False
    #: Coarsest precision in which entropy is computed before being returned in fp32. A backend that
    #: computes "in the input dtype" declares the coarsest it accepts; tolerances (conformance kit)
    #: use the finer of this and the input dtype.
    entropy_precision: Precision = "fp32"
    #: Coarsest precision in which logits are materialised inside the backend; read like
    #: ``entropy_precision`` (the finer of it and the input dtype applies).
    logits_precision: Precision = "fp32"
    #: ``temperature`` may be a tensor broadcastable to the labels' shape.
    per_token_temperature: bool = False
    #: ``softcap=c`` applies ``c * tanh(z / c)`` before the temperature division.
    softcap: bool = False
    #: Vocabulary shards may have unequal sizes under ``process_group``.
    uneven_shards: bool = False


#: Boolean capability names that ``require=[...]`` may ask for.
REQUIRABLE_CAPABILITIES: frozenset[str] = frozenset(
    name for name, field in Capabilities.model_fields.items() if field.annotation in (bool, "bool")
)


class NoOptions(BaseModel):
    """Options model for a backend that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@runtime_checkable
class FusedHeadBackend(Protocol):
    """A named implementation of the fused LM-head log-prob/entropy computation."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]]  # extra fields forbidden
    plugin_api_version: ClassVar[int]

    def __init__(self, options: Any) -> None: ...

    def capabilities(self, device: torch.device) -> Capabilities:
        """Declare what this backend does on ``device``."""
        ...

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ``BackendUnavailableError`` (with the reason and the fix) if it cannot run here."""
        ...

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float | torch.Tensor,
        ignore_index: int,
        return_entropy: bool,
        process_group: Any,
        vocab_start: int,
        vocab_size: int,
        reduce_hidden_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return fp32 ``log_probs [N]`` and ``entropy [N]`` (or None), differentiable."""
        ...
