"""Triton backend tests: where the kernels run is decided per test.

Without CUDA the root conftest sets ``TRITON_INTERPRET=1`` for the whole session before triton is
imported (Triton fixes compiled-or-interpreted when each ``@triton.jit`` function is made, its own
standard library included); CPU tests here also set it explicitly. The backend rebuilds its kernel
modules whenever the setting differs from the one they were built under. Tests marked ``gpu`` run
with the interpreter off, and are skipped with the reason without CUDA.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def triton_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """'gpu' (real kernels on CUDA) or 'interpreter' (kernels on the CPU), for this test only."""
    if request.node.get_closest_marker("gpu") is not None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (compute capability 8.0+); none is visible here")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "gpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "interpreter"
