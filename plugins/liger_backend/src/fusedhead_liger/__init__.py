"""fusedhead-liger: the ``liger`` backend, an explicit adapter over liger-kernel.

Importing this package imports torch and pydantic, not liger-kernel; Liger loads on first use.
"""

from __future__ import annotations

from fusedhead_liger.backend import LigerBackend, LigerOptions

__version__ = "1.0.0"
__all__ = ["LigerBackend", "LigerOptions"]
