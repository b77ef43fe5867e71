"""The backend class the ``fusedhead.backends`` entry point names: options, capabilities, checks."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import Capabilities, HeadCall, HeadOutput
from fusedhead_example_bi.rowwise import RowwiseFusedHead

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class ExampleOptions(BaseModel):
    """Options of ``example-bi``; unknown keys are refused, so a typo fails when the config is read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_block: int = Field(
        8192,
        ge=1,
        description="vocabulary rows per block; results depend on it, never on the batch",
    )


class BatchInvariantBackend:
    """Row by row, vocabulary block by block, with fixed-shape ops: forward is batch invariant."""

    name: ClassVar[str] = "example-bi"
    Options: ClassVar[type[BaseModel]] = ExampleOptions
    plugin_api_version: ClassVar[int] = 2

    def __init__(self, options: ExampleOptions) -> None:
        self.options = options

    def capabilities(self, device: torch.device) -> Capabilities:
        """The same on CPU and CUDA: logits and entropy in fp32, batch invariant, deterministic."""
        return Capabilities(
            devices=("cpu", "cuda"),
            dtypes=("fp32", "fp16", "bf16"),
            deterministic=True,
            batch_invariant=True,
            logits_precision="fp32",
            entropy_precision="fp32",
        )

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ``BackendUnavailableError`` with the reason and the fix if it cannot run here."""
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError(
                "backend 'example-bi' was asked for CUDA but torch sees no CUDA device; use device 'cpu'"
            )
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(
                f"backend 'example-bi' runs on cpu and cuda, not {device.type!r}"
            )
        if dtype not in _DTYPES:
            raise BackendUnavailableError(
                f"backend 'example-bi' takes fp32, fp16 or bf16 inputs, not {dtype}"
            )

    def forward(self, call: HeadCall) -> HeadOutput:
        """fp32 log-probs and entropy of ``call.hidden [N, H]`` against ``call.weight [V, H]``.

        The core never passes a process group, a temperature tensor or a softcap here, since the
        capabilities do not declare vocab_parallel, per_token_temperature or softcap.
        """
        assert call.process_group is None and isinstance(call.temperature, float)
        log_probs, entropy = RowwiseFusedHead.apply(  # type: ignore[no-untyped-call]
            call.hidden,
            call.weight,
            call.labels,
            call.temperature,
            call.ignore_index,
            self.options.vocab_block,
        )
        return HeadOutput(log_probs, entropy if call.return_entropy else None)


#: The name users import (``fusedhead_example_bi.Options``).
Options = ExampleOptions
