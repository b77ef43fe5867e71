"""Fixed tile configurations and the call's settings. They depend on the dtype and the options,
never on N: every row is computed by the same tile program with the same reduction order whatever
the batch size (batch invariance), so there is no autotuning keyed on N anywhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import torch

Memory = Literal["low", "fast"]


@dataclass(frozen=True)
class TileConfig:
    """One GEMM-with-epilogue launch: tile shape, grouping, warps, pipeline depth, loader."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    #: Persistent grid loading through TMA descriptors (Hopper and newer, 16-byte aligned rows).
    tma: bool = False


# 16-bit: persistent TMA grid, 128x256x64 tiles, 8 warps, 3 stages, 16 row tiles per group.
# H200, triton 3.6, N=8192 H=4096 V=151936 bf16 forward: 1.01-1.04 GEMM units (pointer loads: 1.20).
_HALF = TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True)
# fp32 uses the exact ("ieee") FMA dot: smaller tiles, the shared memory is twice as large per value.
_FP32 = TileConfig(64, 128, 32, group_m=8, num_warps=8, num_stages=3)

#: The dz block buffer's bound by ``memory``: "low" (dz blocks in dW's unwritten rows, the sum's
#: low byte stashed in dW's last rows) and "fast" (the sum's exact low half beside the output).
#: H200, N = 32768, bf16, low: 64 MiB 4.38 units / 1.47 GiB, 32 MiB 4.43 / 1.44 GiB.
BLOCK_BYTES = {"low": 64 * 2**20, "fast": 256 * 2**20}
#: Widest backward block (vocabulary columns); 16384 measured ~1 % faster, within the spread.
MAX_COLS = 8192


@dataclass(frozen=True)
class Settings:
    """Everything the kernels of a call take that is neither a tensor nor a per-call scalar."""

    forward: TileConfig
    dz: TileConfig
    dh: TileConfig
    memory: Memory = "low"
    #: Bound on the backward's dz block buffer in bytes (None: ``BLOCK_BYTES[memory]``).
    block_bytes: int | None = None

    def key(self) -> str:
        """A string that ``from_key`` turns back into these settings (custom ops take strings)."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    @lru_cache(maxsize=64)
    def from_key(key: str) -> Settings:
        """The settings ``key`` was made from."""
        raw = json.loads(key)
        forward, dz, dh = (TileConfig(**raw.pop(k)) for k in ("forward", "dz", "dh"))
        return Settings(forward, dz, dh, raw["memory"], raw["block_bytes"])


def interpret_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def settings_for(
    dtype: torch.dtype,
    *,
    memory: Memory = "low",
    block_bytes: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    tma: bool | None = None,
) -> Settings:
    """The shipped tiles for ``dtype`` with the overrides applied to all three launches."""
    base = _FP32 if dtype == torch.float32 else _HALF
    changes: dict[str, Any] = {
        "block_m": block_m,
        "block_n": block_n,
        "block_k": block_k,
        "tma": tma,
    }
    tile = replace(base, **{k: v for k, v in changes.items() if v is not None})
    return Settings(tile, tile, tile, memory, block_bytes)
