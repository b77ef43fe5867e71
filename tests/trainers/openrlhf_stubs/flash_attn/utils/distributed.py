"""Ring attention's all-gather is not needed on one CPU process (tests only)."""

from __future__ import annotations

from typing import Any

import torch


def all_gather(input_: torch.Tensor, process_group: Any) -> torch.Tensor:
    """Not provided: only OpenRLHF's ring attention calls it."""
    raise NotImplementedError("the flash_attn test stub has no all_gather (ring attention)")
