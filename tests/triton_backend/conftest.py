"""Triton backend tests: each test says where its kernels run.

Triton fixes compiled-or-interpreted when each ``@triton.jit`` function is made, its own standard
library included, so a session runs one way (tests/conftest.py): the CPU suite under the
interpreter (``TRITON_INTERPRET=1``; on a CUDA machine with the GPU hidden), the tests marked
``gpu`` skipped with the reason; a GPU session (``-m gpu``) compiled. The fixture below keeps the
setting each test expects for the calls it makes.
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
