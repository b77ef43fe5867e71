"""One launcher per kernel: allocate outputs, pick the fixed config, launch.

The kernel modules are imported on the first launch (importing ``fusedhead_triton`` stays cheap).
``TRITON_INTERPRET`` must be set before that: ``@triton.jit`` decides between the compiler and
the CPU interpreter when the decorator runs.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

from .configs import TileConfig, interpret_enabled
from .sum_format import DhSum

#: Rows per program and tiles per step of the row-combine kernel (fixed: batch invariance).
COMBINE_BLOCK_R = 64
COMBINE_BLOCK_T = 64


def kernel(name: str) -> ModuleType:
    """The kernel module ``kernels.<name>``."""
    return importlib.import_module(f"{__package__}.kernels.{name}")


@dataclass(frozen=True)
class HeadScalars:
    """Per-call scalars shared by the forward and backward launches."""

    label_offset: int
    ignore_index: int
    inv_temp: float
    softcap: float | None

    @property
    def softcap_args(self) -> tuple[float, float]:
        return (self.softcap, 1.0 / self.softcap) if self.softcap is not None else (0.0, 0.0)


class RowGrads(NamedTuple):
    """Per-row inputs of the dz kernel (unused ones are a dummy never read)."""

    labels: torch.Tensor
    temp: torch.Tensor | None
    lse: torch.Tensor
    ent: torch.Tensor | None
    g_lp: torch.Tensor | None
    g_ent: torch.Tensor | None

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.lse if t is None else t for t in self)


class Partials(NamedTuple):
    """Per-tile statistics ``ws[3, T, N]`` (max, sum of exp, sum of exp * (z - max)) and the
    label logit ``zy[N]`` (NaN where the label is not in this shard)."""

    ws: torch.Tensor
    zy: torch.Tensor


class RowOutputs(NamedTuple):
    """A row's final outputs: log_prob, log-sum-exp and entropy (a dummy when not asked)."""

    log_probs: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor


class RowPartials(NamedTuple):
    """A row's statistics over one shard: max logit ``m``, ``s`` = sum exp(z - m) and
    ``w`` = sum exp(z - m) (z - m) (what a vocab-parallel rank gathers)."""

    m: torch.Tensor
    s: torch.Tensor
    w: torch.Tensor


def precision(dtype: torch.dtype) -> str:
    """fp32 dots are exact ("ieee"), never silently TF32; 16-bit dots use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def tma_usable(cfg: TileConfig, dtype: torch.dtype, hidden_size: int, device: torch.device) -> bool:
    """TMA path only where it applies to every row alike: depends on H, dtype, device, never N."""
    if not cfg.tma or (hidden_size * torch.finfo(dtype).bits // 8) % 16 != 0:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # triton < 3.4
        return False
    if device.type == "cuda" and not interpret_enabled():
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return interpret_enabled()


def descriptor(t: torch.Tensor, block: list[int]) -> Any:
    """A TMA descriptor of ``t`` (made contiguous unless its rows are 16-byte aligned)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    esize = t.element_size()
    if t.stride(-1) != 1 or (t.stride(0) * esize) % 16 or t.data_ptr() % 16:
        t = t.contiguous()
    return TensorDescriptor.from_tensor(t, block)


def _tiles(cfg: TileConfig, dtype: torch.dtype, **flags: Any) -> dict[str, Any]:
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=precision(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )  # fmt: skip


def forward_partials(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, cfg: TileConfig,
) -> Partials:  # fmt: skip
    """The forward's tile statistics: one logits tile at a time, never the logits."""
    fwd = kernel("forward")
    (n, h), v = hidden.shape, weight.shape[0]
    t = math.ceil(v / cfg.block_n)
    ws = torch.empty((3, t, n), dtype=torch.float32, device=hidden.device)
    zy = torch.full((n,), float("nan"), dtype=torch.float32, device=hidden.device)
    if t == 0:
        return Partials(ws, zy)
    flags = _tiles(
        cfg, hidden.dtype, PER_TOKEN_T=temp is not None, HAS_SOFTCAP=sc.softcap is not None
    )
    scalars = (sc.label_offset, sc.inv_temp, *sc.softcap_args)
    temp_arg = temp if temp is not None else zy  # never read without PER_TOKEN_T
    tiles = math.ceil(n / cfg.block_m) * t
    if tma_usable(cfg, hidden.dtype, h, hidden.device):
        hd = descriptor(hidden, [cfg.block_m, cfg.block_k])
        wd = descriptor(weight, [cfg.block_n, cfg.block_k])
        progs = num_programs(hidden.device)
        fwd.fwd_stats_tma_kernel[(min(progs, tiles),)](
            hd, wd, labels, temp_arg, ws, zy, n, v, h, *scalars, NUM_PROGS=progs, **flags
        )
    else:
        fwd.fwd_stats_kernel[(tiles,)](
            hidden, weight, labels, temp_arg, ws, zy, n, v, h, *hidden.stride(), *weight.stride(),
            *scalars, EVEN_K=h % cfg.block_k == 0, **flags,
        )  # fmt: skip
    return Partials(ws, zy)


def _combine(
    p: Partials, labels: torch.Tensor, ignore_index: int, final: bool, entropy: bool
) -> list[torch.Tensor]:
    """Reduce ``ws[3, T, N]`` over T in a fixed order (batch invariant, deterministic)."""
    _, t, n = p.ws.shape
    outs = [torch.empty(n, dtype=torch.float32, device=p.ws.device) for _ in range(3)]
    kernel("forward").combine_kernel[(math.ceil(n / COMBINE_BLOCK_R),)](
        p.ws, p.zy, labels, *outs, n, t, ignore_index, BLOCK_R=COMBINE_BLOCK_R,
        BLOCK_T=COMBINE_BLOCK_T, FINAL=final, HAS_ENT=entropy, num_warps=4,
    )  # fmt: skip
    return outs


def combine(p: Partials, labels: torch.Tensor, ignore_index: int, *, entropy: bool) -> RowOutputs:
    """The rows' outputs from the tile statistics (or from every rank's, gathered)."""
    return RowOutputs(*_combine(p, labels, ignore_index, True, entropy))


def shard_stats(p: Partials, labels: torch.Tensor, ignore_index: int) -> RowPartials:
    """The rows' (m, s, w) over this shard, for the cross-rank combine."""
    return RowPartials(*_combine(p, labels, ignore_index, False, False))


def dz_block(
    hidden: torch.Tensor, weight: torch.Tensor, rows: RowGrads, sc: HeadScalars, cfg: TileConfig,
    v0: int, dz: torch.Tensor,
) -> None:  # fmt: skip
    """Write ``dz[N, cols]`` of vocabulary rows [v0, v0 + cols) from their recomputed logits."""
    dzk = kernel("dz")
    (n, h), cols = hidden.shape, dz.shape[1]
    wb = weight[v0 : v0 + cols]
    flags = _tiles(
        cfg, hidden.dtype, PER_TOKEN_T=rows.temp is not None, HAS_SOFTCAP=sc.softcap is not None,
        HAS_GLP=rows.g_lp is not None, HAS_GENT=rows.g_ent is not None,
    )  # fmt: skip
    scalars = (sc.label_offset + v0, sc.ignore_index, sc.inv_temp, *sc.softcap_args)
    tiles = math.ceil(n / cfg.block_m) * math.ceil(cols / cfg.block_n)
    if tma_usable(cfg, hidden.dtype, h, hidden.device):
        hd = descriptor(hidden, [cfg.block_m, cfg.block_k])
        wd = descriptor(wb, [cfg.block_n, cfg.block_k])
        zd = descriptor(dz, [cfg.block_m, cfg.block_n])
        progs = num_programs(hidden.device)
        dzk.dz_tma_kernel[(min(progs, tiles),)](
            hd, wd, zd, *rows.args(), n, cols, h, *scalars, NUM_PROGS=progs, **flags
        )
    else:
        dzk.dz_kernel[(tiles,)](
            hidden, wb, *rows.args(), dz, n, cols, h, *hidden.stride(), *wb.stride(), dz.stride(0),
            *scalars, EVEN_K=h % cfg.block_k == 0, **flags,
        )  # fmt: skip


def dh_block(
    dz: torch.Tensor, weight: torch.Tensor, v0: int, acc: DhSum, cfg: TileConfig, *,
    first: bool, last: bool,
) -> None:  # fmt: skip
    """Add ``dz @ W[v0 : v0 + cols]`` to the running sum (``first``: start it; ``last``: write
    the result to ``acc.out``)."""
    dhk = kernel("dh")
    (n, cols), h = dz.shape, weight.shape[1]
    wb = weight[v0 : v0 + cols]
    flags = _tiles(cfg, dz.dtype, FIRST=first, LAST=last, SUM_LO=acc.sum_lo)
    tiles = math.ceil(n / cfg.block_m) * math.ceil(h / cfg.block_n)
    if tma_usable(cfg, dz.dtype, h, dz.device):
        zd = descriptor(dz, [cfg.block_m, cfg.block_k])
        wd = descriptor(wb, [cfg.block_k, cfg.block_n])
        progs = num_programs(dz.device)
        dhk.dh_tma_kernel[(min(progs, tiles),)](
            zd, wd, acc.hi, acc.lo, acc.out, n, h, cols, NUM_PROGS=progs, **flags
        )
    else:
        dhk.dh_kernel[(tiles,)](
            dz, wb, acc.hi, acc.lo, acc.out, n, h, cols, dz.stride(0), *wb.stride(),
            EVEN_K=cols % cfg.block_k == 0, EVEN_N=h % cfg.block_n == 0, **flags,
        )  # fmt: skip
