"""fusedhead-torch: the chunked PyTorch backend of fusedhead, registered under the name ``torch``."""

from __future__ import annotations

from fusedhead_torch.backend import TorchBackend
from fusedhead_torch.options import TorchOptions

__all__ = ["TorchBackend", "TorchOptions"]
__version__ = "1.0.0"
