"""One launcher per kernel: allocate outputs, pick the fixed config, launch.

Each kernel is imported by name from ``kernels/`` here, so this module imports triton: the
backend imports it on its first call (importing ``fusedhead_triton`` stays cheap).
``TRITON_INTERPRET`` must be set before that: ``@triton.jit`` decides between the compiler and
the CPU interpreter when the decorator runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .configs import TileConfig, interpret_enabled
from .kernels.dh import dh_kernel, dh_tma_kernel
from .kernels.dz import dz_kernel
from .kernels.forward import combine_kernel, finish_kernel, fwd_stats_kernel
from .kernels.sparse import tile_starts_kernel
from .sum_format import DhSum

#: Rows per program and tiles per step of the row-combine kernel (fixed: batch invariance).
COMBINE_BLOCK_R = 64
COMBINE_BLOCK_T = 64
#: Fraction bits of the combine's fixed-point sums (``kernels.forward.combine_kernel``): each
#: tile's rebased term is at most its column count, so a row's int64 sums stay below ``2**63``
#: while the vocabulary is below ``MAX_GRID_VOCAB`` columns.
FIXED_BITS = 40
MAX_GRID_VOCAB = 2 ** (63 - FIXED_BITS)


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
    """Per-row inputs of the dz kernel (unused ones are a dummy never read); ``norm [2, N]``:
    each row's max and ``log s`` of the scaled logits, so ``log p = (z - max) - log s``, never
    ``z - lse`` (whose rounding to an ulp of the max is the size of a confident row's ``1 - p``)."""

    labels: torch.Tensor
    temp: torch.Tensor | None
    norm: torch.Tensor
    log_probs: torch.Tensor
    ent: torch.Tensor | None
    g_lp: torch.Tensor | None
    g_ent: torch.Tensor | None

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.norm if t is None else t for t in self)


class Partials(NamedTuple):
    """Per-tile statistics ``ws[3, T, N]`` (max, sum of exp, sum of exp * (z - max)) and the
    label logit ``zy[N]`` (NaN where the label is not in this shard); where asked, ``q[T, N]``
    (sum of exp(2 (z - max))), ``arg[T, N]`` (the tile's argmax column, int32) and ``zg[N, K]``
    (the logits at the sorted caller ids, NaN where this shard does not own the id)."""

    ws: torch.Tensor
    zy: torch.Tensor
    q: torch.Tensor | None = None
    arg: torch.Tensor | None = None
    zg: torch.Tensor | None = None


class SortedIds(NamedTuple):
    """Caller ids per row, shard-local and sorted (``kernels.sparse``): ``sids[N, K]`` int32
    (ids this shard does not count are ``SENTINEL``) and ``perm[N, K]`` (sorted position ->
    caller position)."""

    sids: torch.Tensor
    perm: torch.Tensor


class PartialExtras(NamedTuple):
    """What the forward's tiles compute past the log-prob statistics."""

    sum_p2: bool = False
    argmax: bool = False
    gather: SortedIds | None = None


class ExtraRowOutputs(NamedTuple):
    """``RowOutputs`` and the extras (each a dummy when not asked): sum of squared p, argmax;
    the row max and ``log s`` (any id's log-prob is ``(z - row_max) - log_s``)."""

    log_probs: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    sum_p2: torch.Tensor
    argmax: torch.Tensor
    row_max: torch.Tensor
    log_s: torch.Tensor


class RowOutputs(NamedTuple):
    """A row's final outputs: log_prob, the normaliser ``[2, N]`` (row max, ``log s``: what the
    backward reads) and entropy (a dummy when not asked)."""

    log_probs: torch.Tensor
    norm: torch.Tensor
    entropy: torch.Tensor


class DzExtras(NamedTuple):
    """Further per-row terms of the dz kernel: ``dz += p (ax + c p) / T`` and the sparse
    ``gs[N, K]`` (fp32, in sorted order) added at the sorted ids; None: off."""

    ax: torch.Tensor | None = None
    c: torch.Tensor | None = None
    ids: SortedIds | None = None
    gs: torch.Tensor | None = None


#: Sorted-id value of an id the shard does not count (sorts past every tile).
SENTINEL = 2**31 - 1
#: Rows and tiles per program of the tile-table kernel.
_STARTS_BLOCK = (64, 16)


def sort_ids(
    ids: torch.Tensor,
    labels: torch.Tensor,
    offset: int,
    v_local: int,
    ignore_index: int,
    drop_ignore_index: bool = True,
) -> SortedIds:
    """``ids [N, K]`` (global) as this shard's sorted local ids: ids on ignored rows, equal to
    ``ignore_index`` (gathered ids; not ``drop_ignore_index``: a top-k id may be that id, and
    the backward zeroes a gathered one's gradient itself) or outside ``[offset, offset +
    v_local)`` become ``SENTINEL``."""
    local = ids - offset
    own = (local >= 0) & (local < v_local)
    if drop_ignore_index:
        own &= ids != ignore_index
    own &= (labels != ignore_index).unsqueeze(1)
    key = torch.where(own, local, SENTINEL).to(torch.int32)
    sids, perm = torch.sort(key, dim=1, stable=True)
    return SortedIds(sids.contiguous(), perm)


def tile_starts(ids: SortedIds, tiles: int, width: int, origin: int = 0) -> torch.Tensor:
    """``starts[t, n]`` (int32 ``[tiles + 1, N]``): row ``n``'s first sorted position at or past
    column ``origin + t * width``, so tile ``t`` holds positions ``[starts[t], starts[t + 1])``."""
    n, k = ids.sids.shape
    out = torch.empty((tiles + 1, n), dtype=torch.int32, device=ids.sids.device)
    br, bt = _STARTS_BLOCK
    grid = (math.ceil(n / br), math.ceil((tiles + 1) / bt))
    if n:
        tile_starts_kernel[grid](
            ids.sids, out, n, k, tiles + 1, origin, width, BLOCK_R=br, BLOCK_T=bt, STEPS=k.bit_length(),
            num_warps=4,
        )  # fmt: skip
    return out


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


def tile_constants(cfg: TileConfig, dtype: torch.dtype, **flags: Any) -> dict[str, Any]:
    """A kernel launch's constants: ``cfg``'s blocks, warps and stages, the dot precision, ``flags``."""
    return dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=precision(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )  # fmt: skip


def forward_workspaces(
    n: int, t: int, block_n: int, ex: PartialExtras, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """The forward's outputs over ``t`` tiles of ``n`` rows: ``ws``, ``zy`` and, where asked,
    ``q`` (sum_p2), ``arg`` (argmax), ``zg`` (gathered logits) and the gather's tile table."""
    ws = torch.empty((3, t, n), dtype=torch.float32, device=dev)
    zy = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    q = torch.zeros((t, n), dtype=torch.float32, device=dev) if ex.sum_p2 else None
    arg = torch.zeros((t, n), dtype=torch.int32, device=dev) if ex.argmax else None
    zg = starts = None
    if ex.gather is not None:
        zg = torch.full((n, ex.gather.sids.shape[1]), float("nan"), dtype=torch.float32, device=dev)
        if t:
            starts = tile_starts(ex.gather, t, block_n)
    return ws, zy, q, arg, zg, starts


def forward_partials(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, cfg: TileConfig, extras: PartialExtras | None = None,
) -> Partials:  # fmt: skip
    """The forward's tile statistics: one logits tile at a time, never the logits."""
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    t = math.ceil(v / cfg.block_n)
    ex = extras if extras is not None else PartialExtras()
    ws, zy, q, arg, zg, starts = forward_workspaces(n, t, cfg.block_n, ex, dev)
    k_g = 0 if ex.gather is None else ex.gather.sids.shape[1]
    if t == 0 or n == 0:  # nothing to compute (and no TMA descriptor of an empty tensor)
        return Partials(ws, zy, q, arg, zg)
    flags = tile_constants(
        cfg, hidden.dtype, PER_TOKEN_T=temp is not None, HAS_SOFTCAP=sc.softcap is not None,
        HAS_Q=q is not None, HAS_ARG=arg is not None, HAS_GATHER=zg is not None,
    )  # fmt: skip
    scalars = (sc.label_offset, sc.inv_temp, *sc.softcap_args)
    temp_arg = temp if temp is not None else zy  # never read without PER_TOKEN_T
    # Dummies for the extras not asked (never read or written: their flags are off).
    extra_args = (
        zy if q is None else q,
        zy if arg is None else arg,
        zy if starts is None else starts,
        zy if ex.gather is None else ex.gather.sids,
        zy if zg is None else zg,
    )
    tiles = math.ceil(n / cfg.block_m) * t
    tma = tma_usable(cfg, hidden.dtype, h, dev)
    hw = (hidden, weight) if not tma else (
        descriptor(hidden, [cfg.block_m, cfg.block_k]),
        descriptor(weight, [cfg.block_n, cfg.block_k]),
    )  # fmt: skip
    progs = num_programs(dev)
    fwd_stats_kernel[(min(progs, tiles),)](
        *hw, labels, temp_arg, ws, zy, *extra_args, n, v, h, k_g, *hidden.stride(),
        *weight.stride(), *scalars, NUM_PROGS=progs, TMA=tma, EVEN_K=h % cfg.block_k == 0,
        **flags,
    )  # fmt: skip
    return Partials(ws, zy, q, arg, zg)


def tile_sums(
    p: Partials, row_max: torch.Tensor | None = None, label_offset: int = 0, arg_width: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(M, sums, arg)`` of ``combine_kernel``: the row max (``row_max`` where given, e.g. the
    max over every rank's shard), the fixed-point sums ``int64 [4, N]`` of the tiles relative to
    it, and where ``p.arg`` is set the argmax id over these tiles (``t * arg_width + column +
    label_offset``; -1 without tiles)."""
    _, t, n = p.ws.shape
    dev = p.ws.device
    m = torch.empty(n, dtype=torch.float32, device=dev)
    sums = torch.empty((4, n), dtype=torch.int64, device=dev)
    arg = torch.empty(n, dtype=torch.int64, device=dev) if p.arg is not None else None
    if n:
        combine_kernel[(math.ceil(n / COMBINE_BLOCK_R),)](
            p.ws, p.zy if p.q is None else p.q, p.zy if p.arg is None else p.arg,
            m if row_max is None else row_max, m, sums, sums if arg is None else arg, n, t,
            label_offset, arg_width, float(2**FIXED_BITS), BLOCK_R=COMBINE_BLOCK_R,
            BLOCK_T=COMBINE_BLOCK_T, HAS_GM=row_max is not None, HAS_Q=p.q is not None,
            HAS_ARG=arg is not None, num_warps=4,
        )  # fmt: skip
    return m, sums, arg


def finish_rows(
    m: torch.Tensor, sums: torch.Tensor, zy: torch.Tensor, labels: torch.Tensor,
    ignore_index: int, *, entropy: bool, sum_p2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(log_prob, lse, entropy-or-dummy, sum_p2-or-dummy, log s) from ``tile_sums``' row max
    and sums (or their sum over ranks): ``finish_kernel``, the one path to the outputs."""
    n = m.shape[0]
    # Separate [N] outputs (a custom op's returns may not alias); sum_p2's only if asked.
    lp, lse, ent, log_s = (torch.empty(n, dtype=torch.float32, device=m.device) for _ in range(4))
    p2 = torch.empty(n if sum_p2 else 0, dtype=torch.float32, device=m.device)
    if n:
        finish_kernel[(math.ceil(n / COMBINE_BLOCK_R),)](
            m, sums, zy, labels, lp, lse, log_s, ent, p2 if sum_p2 else ent, n, ignore_index,
            float(2.0**-FIXED_BITS), BLOCK_R=COMBINE_BLOCK_R, HAS_ENT=entropy, HAS_Q=sum_p2,
            num_warps=4,
        )  # fmt: skip
    return lp, lse, ent, p2, log_s


def combine(p: Partials, labels: torch.Tensor, ignore_index: int, *, entropy: bool) -> RowOutputs:
    """The rows' outputs from one shard's tile statistics (its whole vocabulary)."""
    m, sums, _ = tile_sums(p)
    lp, _, ent, _, log_s = finish_rows(
        m, sums, p.zy, labels, ignore_index, entropy=entropy, sum_p2=False
    )
    return RowOutputs(lp, torch.stack((m, log_s)), ent)


def combine_extras(
    p: Partials, labels: torch.Tensor, ignore_index: int, *, entropy: bool, label_offset: int = 0,
    arg_width: int = 0,
) -> ExtraRowOutputs:  # fmt: skip
    """``combine`` with the sum of squared p (from ``p.q``) and the argmax (from ``p.arg``; -1
    on ignored rows)."""
    m, sums, arg = tile_sums(p, None, label_offset, arg_width)
    lp, lse, ent, p2, log_s = finish_rows(
        m, sums, p.zy, labels, ignore_index, entropy=entropy, sum_p2=p.q is not None
    )
    if arg is not None:
        arg = torch.where(labels != ignore_index, arg, -1)
    return ExtraRowOutputs(lp, lse, ent, p2, lp if arg is None else arg, m, log_s)


def dz_block(
    hidden: torch.Tensor, weight: torch.Tensor, rows: RowGrads, sc: HeadScalars, cfg: TileConfig,
    v0: int, dz: torch.Tensor, extra: DzExtras | None = None,
) -> None:  # fmt: skip
    """Write ``dz[N, cols]`` of vocabulary rows [v0, v0 + cols) from their recomputed logits."""
    (n, h), cols = hidden.shape, dz.shape[1]
    wb = weight[v0 : v0 + cols]
    ex = extra if extra is not None else DzExtras()
    sparse = ex.ids is not None and ex.gs is not None
    tiles_n = math.ceil(cols / cfg.block_n)
    # This block's own tile table: blocks need not start on a multiple of the tile width.
    starts = tile_starts(ex.ids, tiles_n, cfg.block_n, v0) if sparse else None  # type: ignore[arg-type]
    flags = tile_constants(
        cfg, hidden.dtype, PER_TOKEN_T=rows.temp is not None, HAS_SOFTCAP=sc.softcap is not None,
        HAS_GLP=rows.g_lp is not None, HAS_GENT=rows.g_ent is not None,
        HAS_AX=ex.ax is not None, HAS_C=ex.c is not None, HAS_SPARSE=sparse,
    )  # fmt: skip
    scalars = (sc.label_offset + v0, sc.ignore_index, sc.inv_temp, *sc.softcap_args)
    dummy = rows.norm
    extra_args = (
        dummy if ex.ax is None else ex.ax,
        dummy if ex.c is None else ex.c,
        dummy if starts is None else starts,
        ex.ids.sids if sparse else dummy,  # type: ignore[union-attr]
        ex.gs if sparse else dummy,
    )
    k_sp = ex.ids.sids.shape[1] if sparse else 0  # type: ignore[union-attr]
    sp_scalars = (k_sp, v0)
    tiles = math.ceil(n / cfg.block_m) * tiles_n
    tma = tma_usable(cfg, hidden.dtype, h, hidden.device)
    ops = (hidden, wb, dz) if not tma else (
        descriptor(hidden, [cfg.block_m, cfg.block_k]),
        descriptor(wb, [cfg.block_n, cfg.block_k]),
        descriptor(dz, [cfg.block_m, cfg.block_n]),
    )  # fmt: skip
    progs = num_programs(hidden.device)
    dz_kernel[(min(progs, tiles),)](
        *ops, *rows.args(), *extra_args, n, cols, h, *hidden.stride(), *wb.stride(),
        dz.stride(0), *scalars, *sp_scalars, NUM_PROGS=progs, TMA=tma,
        EVEN_K=h % cfg.block_k == 0, **flags,
    )  # fmt: skip


def dh_block(
    dz: torch.Tensor, weight: torch.Tensor, v0: int, acc: DhSum, cfg: TileConfig, *,
    first: bool, last: bool,
) -> None:  # fmt: skip
    """Add ``dz @ W[v0 : v0 + cols]`` to the running sum (``first``: start it; ``last``: write
    the result to ``acc.out``)."""
    (n, cols), h = dz.shape, weight.shape[1]
    wb = weight[v0 : v0 + cols]
    flags = tile_constants(cfg, dz.dtype, FIRST=first, LAST=last, SUM_LO=acc.sum_lo)
    tiles = math.ceil(n / cfg.block_m) * math.ceil(h / cfg.block_n)
    if tma_usable(cfg, dz.dtype, h, dz.device):
        zd = descriptor(dz, [cfg.block_m, cfg.block_k])
        wd = descriptor(wb, [cfg.block_k, cfg.block_n])
        progs = num_programs(dz.device)
        dh_tma_kernel[(min(progs, tiles),)](
            zd, wd, acc.hi, acc.lo, acc.out, n, h, cols, NUM_PROGS=progs, **flags
        )
    else:
        dh_kernel[(tiles,)](
            dz, wb, acc.hi, acc.lo, acc.out, n, h, cols, dz.stride(0), *wb.stride(),
            EVEN_K=cols % cfg.block_k == 0, EVEN_N=h % cfg.block_n == 0, **flags,
        )  # fmt: skip
