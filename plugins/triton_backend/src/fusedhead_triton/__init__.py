"""fusedhead-triton: the ``triton`` backend of fusedhead (fused, batch-invariant Triton kernels).

Importing this package imports torch and pydantic but not triton; the kernels are built on the
first call.
"""

from __future__ import annotations

from .backend import TritonBackend, TritonOptions

__all__ = ["TritonBackend", "TritonOptions"]
__version__ = "1.0.0"
