"""Error measures of the bench, with no dependency on its cases: the reference's dtype per device
and the relative/max error of one tensor against another (shared by accuracy and the policy case)."""

from __future__ import annotations

import math

import torch


def reference_dtype(device: torch.device) -> torch.dtype:
    """float64 on the CPU; fp32 on a GPU (float64 GEMMs of the GPU shapes would dominate the run)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def error(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Relative L2 and max abs error of ``a`` against ``b`` (NaN anywhere gives NaN)."""
    a = a.detach().to(b.dtype)
    diff = (a - b).to(torch.float64)
    denom = float(torch.linalg.vector_norm(b.to(torch.float64)))
    num = float(torch.linalg.vector_norm(diff))
    rel = num / denom if denom > 0 else (0.0 if num == 0 else math.inf)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    if bool(torch.isnan(a).any()):
        rel = max_abs = math.nan
    return {"rel": rel, "max_abs": max_abs}
