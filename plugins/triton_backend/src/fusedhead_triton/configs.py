"""Fixed tile configurations. They depend on the dtype (and the options), never on N.

That is what makes the forward batch invariant: every row is computed by the same tile program
with the same reduction order whatever the batch size, so no autotuning keyed on N anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch


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
    #: Persistent dh kernel only: one flattened software pipeline over tiles and K steps, so the
    #: next tile's loads overlap this tile's read-modify-write of the running sum.
    flatten: bool = False
    #: Persistent dh kernel only: read-modify-write the running sum in this many column slices
    #: (1, 2 or 4; fewer live registers in the epilogue).
    epilogue_splits: int = 1
    #: Persistent dh kernel only: load the tile's running sum before its K loop (takes
    #: registers: meant for 128 x 128 tiles).
    prefetch_sum: bool = False
    #: Persistent dh kernel only: programs per SM (2 lets one program's epilogue overlap the
    #: other's main loop, where the shared memory of two fits).
    programs_per_sm: int = 1
    #: Persistent dh kernel only: Triton's warp specialization of the K loop.
    warp_specialize: bool = False
    #: Persistent dh kernel only: read and write the running sum through TMA descriptors.
    tma_sum: bool = False


@dataclass(frozen=True)
class BackendConfigs:
    """The three launches of a forward + backward."""

    forward: TileConfig
    dz: TileConfig
    dh: TileConfig


def interpret_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# 16-bit: persistent TMA grid, 128x256x64 tiles, 8 warps, 3 stages, 16 row tiles per group.
# H200, triton 3.6, N=8192 H=4096 V=151936 bf16 forward: 1.01-1.04 GEMM units (pointer loads: 1.20).
_HALF = TileConfig(
    block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, tma=True
)
# fp32 uses the exact ("ieee") FMA dot: smaller tiles, the shared memory is twice as large per value.
_FP32 = TileConfig(block_m=64, block_n=128, block_k=32, group_m=8, num_warps=8, num_stages=3)


# The dh kernel updates its running sum in two column halves (the whole 128 x 256 tile's
# read-modify-write needs more registers than a thread has). H200, N = 32768, bf16 pair: 4.27 against 4.38 units
# (docs/bench/h200-dh-kernels.json), 4.74 against 5.26 with a 64 MiB dz budget
# (docs/bench/h200-stash-explore.json).
_HALF_DH = replace(_HALF, epilogue_splits=2)


def default_configs(dtype: torch.dtype) -> BackendConfigs:
    """The shipped configs for ``dtype`` (chosen from H200 measurements, see tools/gpu_check.py)."""
    if dtype == torch.float32:
        return BackendConfigs(forward=_FP32, dz=_FP32, dh=_FP32)
    return BackendConfigs(forward=_HALF, dz=_HALF, dh=_HALF_DH)


def with_overrides(
    configs: BackendConfigs,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    tma: bool | None = None,
) -> BackendConfigs:
    """Apply option overrides to all three launches (same tile shape everywhere)."""
    changes: dict[str, int | bool] = {}
    if block_m is not None:
        changes["block_m"] = block_m
    if block_n is not None:
        changes["block_n"] = block_n
    if block_k is not None:
        changes["block_k"] = block_k
    if tma is not None:
        changes["tma"] = tma
    if not changes:
        return configs
    return BackendConfigs(
        forward=replace(configs.forward, **changes),
        dz=replace(configs.dz, **changes),
        dh=replace(configs.dh, **changes),
    )
