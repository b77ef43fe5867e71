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
#: Widest backward block (vocabulary columns) in the dz buffer, and in the KL's backward.
MAX_COLS = 8192
#: Widest block of the log-prob head whose dz lies in dW's unwritten rows (no memory cost).
#: H200, bf16, low: against 8192, 0.4 % faster at N = 8192 and 0.9-1.2 % at 32768, the same peak
#: (two rounds of one call, and a call of 11-29; docs/benchmarks.md).
LENT_COLS = 16384


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


#: Largest ``top_k`` (the selection's running set lives in registers: ``SELECT_ROWS x KP``;
#: one shard only). Here so that the capabilities do not import the kernels.
MAX_TOP_K = 64
#: The vocabulary grid on which vocab-parallel results are the one-process bits: every forward
#: tile width (``block_n``, a power of two up to 1024) divides it.
GRID_COLS = 1024
#: Widest KL tile: both heads' fp32 accumulators are live at once (two 128 x 128 tiles over 8 warps
#: take 128 registers a thread; two 128 x 256 ones would not fit).
KL_MAX_BLOCK_N = 128
#: Pipeline stages of the 16-bit TMA tile (128 x 128 x 64: 32 KiB a stage and head). On an H200
#: (``tools/kl_sweep.py``, bf16, N = 8192, H = 4096, V = 151936) 4 stages against the log-prob
#: kernels' 3 take the forward from 2.66 to 2.25 GEMM units and the backward from 4.86 to 4.55.
KL_TMA_STAGES = 4
#: Row tiles a group of the 16-bit TMA tile's programs shares a vocabulary chunk over (the
#: log-prob kernels: 16). On an H200 an A/B of the two trees (``scripts/gpu/ab.sh``, two rounds)
#: read ``fused_kl`` 0.5 % faster forward and 0.6 % faster forward + backward (docs/benchmarks.md).
KL_TMA_GROUP_M = 8


def kl_tile(cfg: TileConfig) -> TileConfig:
    """A KL kernel's tile: the log-prob kernel's ``cfg``, at most ``KL_MAX_BLOCK_N`` wide, with
    ``KL_TMA_STAGES`` stages and ``KL_TMA_GROUP_M`` row tiles a group on the (16-bit) TMA tile."""
    tile = replace(cfg, block_n=min(cfg.block_n, KL_MAX_BLOCK_N))
    return replace(tile, num_stages=KL_TMA_STAGES, group_m=KL_TMA_GROUP_M) if tile.tma else tile


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


# --- shared memory: what the configured tiles stage, against the device's limit ------------------

#: Bytes a kernel holds in shared memory past its staged tiles (mbarriers, reduction scratch):
#: at most 1 KiB in every kernel of the shipped configs compiled on an H200 (triton 3.6).
SHARED_SLACK = 1024


@dataclass(frozen=True)
class SharedUse:
    """One kernel's estimated shared memory per block: its tile, the bytes and how they add up."""

    kernel: str
    tile: TileConfig
    nbytes: int
    terms: str


def _staged(kernel: str, cfg: TileConfig, esize: int, *, tma: bool, store: bool) -> SharedUse:
    """The operand tiles' pipeline buffers (``[block_m, block_k]`` and ``[block_n, block_k]``
    each), plus what the TMA path stages past them where ``tma``: the output tile of a TMA store
    (``store``) and, for fp32, the transposed weight tile the FMA dot reads.

    16-bit tiles (tensor-core dots) hold ``num_stages`` buffers; fp32 ("ieee" FMA dots) hold
    ``num_stages - 1``, as Triton 3.6 compiles them on an H200.
    """
    fp32 = esize == 4
    buffers = cfg.num_stages - 1 if fp32 else cfg.num_stages
    nbytes = buffers * (cfg.block_m + cfg.block_n) * cfg.block_k * esize + SHARED_SLACK
    terms = f"{buffers} buffers x ({cfg.block_m} + {cfg.block_n}) x {cfg.block_k} x {esize} B"
    if tma and fp32:
        nbytes += cfg.block_n * cfg.block_k * esize
        terms += f" + a {cfg.block_n} x {cfg.block_k} x {esize} B transposed weight tile"
    if tma and store:
        nbytes += cfg.block_m * cfg.block_n * esize
        terms += f" + a {cfg.block_m} x {cfg.block_n} x {esize} B TMA store tile"
    return SharedUse(kernel, cfg, nbytes, f"{terms} + {SHARED_SLACK} B")


def shared_memory_estimates(st: Settings, element_size: int, *, tma: bool) -> list[SharedUse]:
    """Each kernel's shared memory per block for the settings ``st`` (inputs of ``element_size``
    bytes); ``tma``: the device takes the TMA path where a tile asks for it (Hopper+).

    Every logits GEMM pipelines its two operand tiles (``_staged``): the forward (``hidden``,
    ``weight``), dz (the same, then its output tile through a TMA store), dh (``dz`` and
    ``weight``, not transposed); the two-head KL kernels (``kl_tile``: at most 128 columns,
    4 stages on the 16-bit TMA tile) run one K loop per head, so one head's operands are staged
    at a time, and kl_dz stores like dz. The top-k recompute stages at most the forward's tile.
    On an H200 (triton 3.6) each of 75 kernels compiled in 20 configurations (the shipped ones, TMA
    and pointers, and oversized tiles) took at most this, and at least this minus ``SHARED_SLACK``.
    TMA is assumed wherever the tile asks and the device has it (rows of a hidden size that are
    not 16-byte aligned take the pointer path, without those extra tiles): an upper bound there.
    """
    kl_forward, kl_dz = kl_tile(st.forward), kl_tile(st.dz)
    es = element_size
    return [
        _staged("forward", st.forward, es, tma=tma and st.forward.tma, store=False),
        _staged("dz", st.dz, es, tma=tma and st.dz.tma, store=True),
        _staged("dh", st.dh, es, tma=False, store=False),
        _staged("kl forward", kl_forward, es, tma=tma and kl_forward.tma, store=False),
        _staged("kl dz", kl_dz, es, tma=tma and kl_dz.tma, store=True),
    ]


def shared_memory_excess(
    st: Settings, element_size: int, limit: int, *, tma: bool
) -> SharedUse | None:
    """The kernel whose estimate most exceeds ``limit`` bytes (None: every kernel fits)."""
    over = [u for u in shared_memory_estimates(st, element_size, tma=tma) if u.nbytes > limit]
    return max(over, key=lambda u: u.nbytes) if over else None


def fitting_tile(
    dtype: torch.dtype, element_size: int, limit: int, *, tma: bool, memory: Memory = "low",
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
    tma_option: bool | None = None,
) -> dict[str, int] | None:  # fmt: skip
    """Tile options that fit ``limit``, found by halving block_k, then block_n, then block_m of
    the given ones (down to 16); None if none does."""
    base = settings_for(dtype, memory=memory, block_m=block_m, block_n=block_n,
                        block_k=block_k, tma=tma_option).forward  # fmt: skip
    sizes = {"block_m": base.block_m, "block_n": base.block_n, "block_k": base.block_k}
    for name in ("block_k", "block_n", "block_m"):
        while sizes[name] > 16:
            sizes[name] //= 2
            st = settings_for(dtype, memory=memory, tma=tma_option, **sizes)
            if shared_memory_excess(st, element_size, limit, tma=tma) is None:
                return sizes
    return None
