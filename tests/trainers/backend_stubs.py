"""An in-process backend that cannot run on this machine, for the trainers' error messages.

``gpu_only_backend()`` registers ``gpu-only-test``: it declares CUDA and bf16 only, and its
``check`` refuses every other device or dtype with advice in fusedhead's Python terms
(``options={...}``, ``backend=...``), as a real backend's does (liger's native kernel). The
dtypes it was checked with are recorded, so a test can tell which dtype a trainer passed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import fusedhead
from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import Capabilities

NAME = "gpu-only-test"


@contextlib.contextmanager
def gpu_only_backend() -> Iterator[list[torch.dtype]]:
    """Register ``gpu-only-test`` for the block; yields the dtypes its ``check`` was given."""
    from fusedhead_torch.backend import TorchBackend

    checked: list[torch.dtype] = []

    class GpuOnly(TorchBackend):  # type: ignore[misc]
        name = NAME

        def capabilities(self, device: torch.device) -> Capabilities:
            caps = super().capabilities(device)
            return caps.model_copy(update={"devices": ("cuda",), "dtypes": ("bf16",)})

        def check(self, device: torch.device, dtype: torch.dtype) -> None:
            checked.append(dtype)
            if device.type != "cuda" or dtype != torch.bfloat16:
                raise BackendUnavailableError(
                    f"backend {NAME!r} cannot run on {device.type} with {dtype}: it needs a CUDA "
                    'GPU and bf16. Fix: use options={"implementation": "fallback"}, or another '
                    'backend (e.g. backend="torch")'
                )

    fusedhead.register_backend(NAME, GpuOnly)
    try:
        yield checked
    finally:
        fusedhead.unregister_backend(NAME)
        fusedhead.refresh()
