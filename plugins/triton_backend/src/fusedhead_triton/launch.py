"""Thin launchers: allocate outputs and workspaces, pick the fixed config, launch the kernels.

Kernel modules are imported lazily (importing ``fusedhead_triton`` must stay cheap) and re-imported
if ``TRITON_INTERPRET`` changed since they were built, because ``@triton.jit`` decides between the
compiler and the CPU interpreter when the decorator runs.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from . import schedule
from .configs import TileConfig, interpret_enabled

_KERNEL_MODULES = ("common", "forward", "backward")
_loaded: dict[str, ModuleType] = {}
_loaded_mode: bool | None = None

#: Rows per program and tiles per step of the row-combine kernel (fixed: batch invariance).
COMBINE_BLOCK_R = 64
COMBINE_BLOCK_T = 64


def kernels() -> tuple[ModuleType, ModuleType]:
    """The (forward, backward) kernel modules, built for the current interpreter setting."""
    global _loaded_mode
    mode = interpret_enabled()
    if _loaded_mode != mode:
        for name in _KERNEL_MODULES:
            full = f"{__package__}.kernels.{name}"
            mod = importlib.import_module(full)
            _loaded[name] = importlib.reload(mod) if _loaded_mode is not None else mod
        _loaded_mode = mode
    return _loaded["forward"], _loaded["backward"]


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots are exact ("ieee"), never silently TF32; 16-bit dots use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _tensor_descriptor() -> Any:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # triton < 3.4
        return None
    return TensorDescriptor


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def tma_usable(cfg: TileConfig, dtype: torch.dtype, hidden_size: int, device: torch.device) -> bool:
    """TMA path only where it applies to every row alike: depends on H, dtype, device, never N."""
    if not cfg.tma or _tensor_descriptor() is None:
        return False
    if (hidden_size * torch.finfo(dtype).bits // 8) % 16 != 0:
        return False
    if device.type == "cuda" and not interpret_enabled():
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return interpret_enabled()


def _epilogue_splits(cfg: TileConfig) -> int:
    """Column slices of the dh epilogue: as configured (1, 2 or 4), each at least 16 wide."""
    splits = cfg.epilogue_splits if cfg.epilogue_splits in (1, 2, 4) else 1
    while splits > 1 and cfg.block_n // splits < 16:
        splits //= 2
    return splits


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """A TMA-compatible layout of ``t`` (unit inner stride, 16-byte aligned base and rows)."""
    esize = t.element_size()
    if t.stride(-1) == 1 and (t.stride(0) * esize) % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


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


def forward_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    sc: HeadScalars,
    cfg: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-tile stats ``ws[3, T, N]`` and label logits ``zy[N]`` (NaN where not in this shard)."""
    fwd, _ = kernels()
    n, h = hidden.shape
    v = weight.shape[0]
    t = math.ceil(v / cfg.block_n)
    ws = torch.empty((3, t, n), dtype=torch.float32, device=hidden.device)
    zy = torch.full((n,), float("nan"), dtype=torch.float32, device=hidden.device)
    if t == 0:
        return ws, zy, t
    softcap, inv_softcap = sc.softcap_args
    temp_arg = temp if temp is not None else zy  # never read without PER_TOKEN_T
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        PRECISION=_precision(hidden.dtype),
        PER_TOKEN_T=temp is not None,
        HAS_SOFTCAP=sc.softcap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    tiles = math.ceil(n / cfg.block_m) * t
    if tma_usable(cfg, hidden.dtype, h, hidden.device):
        desc = _tensor_descriptor()
        hd = desc.from_tensor(_tma_ready(hidden), [cfg.block_m, cfg.block_k])
        wd = desc.from_tensor(_tma_ready(weight), [cfg.block_n, cfg.block_k])
        progs = min(_num_programs(hidden.device), tiles)
        fwd.fwd_stats_tma_kernel[(progs,)](
            hd, wd, labels, temp_arg, ws, zy, n, v, h, sc.label_offset, sc.inv_temp,
            softcap, inv_softcap, NUM_PROGS=_num_programs(hidden.device), **common,
        )  # fmt: skip
    else:
        fwd.fwd_stats_kernel[(tiles,)](
            hidden, weight, labels, temp_arg, ws, zy, n, v, h,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            sc.label_offset, sc.inv_temp, softcap, inv_softcap,
            EVEN_K=h % cfg.block_k == 0, **common,
        )  # fmt: skip
    return ws, zy, t


def combine(
    ws: torch.Tensor,
    zy: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    *,
    final: bool,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduce ``ws[3, T, N]`` over T in a fixed order.

    final: (log_prob, lse, entropy); entropy is a dummy when not asked. Otherwise the row's
    combined (m, s, w) for the cross-rank combine.
    """
    fwd, _ = kernels()
    _, t, n = ws.shape
    outs = [torch.empty(n, dtype=torch.float32, device=ws.device) for _ in range(3)]
    fwd.combine_kernel[(math.ceil(n / COMBINE_BLOCK_R),)](
        ws, zy, labels, outs[0], outs[1], outs[2], n, t, ignore_index,
        BLOCK_R=COMBINE_BLOCK_R, BLOCK_T=COMBINE_BLOCK_T, FINAL=final, HAS_ENT=entropy,
        num_warps=4,
    )  # fmt: skip
    return outs[0], outs[1], outs[2]


def vocab_block(n: int, v: int, esize: int, budget_bytes: int, align: int, max_cols: int) -> int:
    """Columns of the backward's ``dz[N, Vb]`` block: within the byte budget and ``max_cols``,
    a multiple of ``align`` (at least one), never wider than the vocabulary needs."""
    cols = min(budget_bytes // max(1, n * esize), max_cols)
    cols = max(align, cols // align * align)
    return min(cols, math.ceil(v / align) * align)


_CUBLAS_FP32_OUT: bool | None = None
#: ``dh_gemm="auto"`` with fp16 inputs uses cuBLAS up to this fp32 accumulator size (N * H * 4
#: bytes). bf16 takes the Triton kernel and its split sum: with the bf16 pair, updated in two
#: column halves, it beat cuBLAS on an H200 at N = 8192 (4.08 against 4.26 units, 1.41 against
#: 1.47 GiB; docs/bench/h200-dh-kernels.json), within 3 % of it at N = 32768 with 0.25 GiB less.
AUTO_CUBLAS_ACC_BYTES = 256 * 2**20


def cublas_fp32_out_available(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` runs here (16-bit in, fp32 C)."""
    global _CUBLAS_FP32_OUT
    if device.type != "cuda" or interpret_enabled():
        return False
    if _CUBLAS_FP32_OUT is None:
        try:
            a = torch.ones((16, 16), dtype=torch.bfloat16, device=device)
            c = torch.ones((16, 16), dtype=torch.float32, device=device)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _CUBLAS_FP32_OUT = bool(c[0, 0].item() == 17.0)
        except (TypeError, RuntimeError, NotImplementedError):
            _CUBLAS_FP32_OUT = False
    return _CUBLAS_FP32_OUT


#: The dz block buffer's default bound: alone, and in the low-memory layout (dz blocks in dW's
#: lent rows, which hold the wide early blocks, and the sum stashed). H200, N = 32768, bf16, stashed fp24 sum: 64 MiB 4.38 units / 1.47 GiB, 32 MiB
#: 4.43 / 1.44 GiB (docs/bench/h200-lend.json).
BLOCK_BYTES = 256 * 2**20
BLOCK_BYTES_LENT = 64 * 2**20


def default_block_bytes(
    lend_dw_rows: bool, stash_dh_sum: bool, need_dw: bool, need_dh: bool
) -> int:
    """The dz buffer's bound when none is configured: small only in the low-memory layout."""
    low_memory = lend_dw_rows and stash_dh_sum and need_dw and need_dh
    return BLOCK_BYTES_LENT if low_memory else BLOCK_BYTES


#: The hidden-gradient sum's formats when split (``SUM_LO`` of the dh kernels): the bf16 pair
#: (bf16 inputs; fp16 keeps a plain fp32 buffer), exact fp32 as two 16-bit halves, or fp32 rounded
#: to a 16-bit significand in three bytes. The high half always lives in the output's buffer.
SUM_FORMATS = {"pair": 0, "fp32": 16, "fp24": 8}


@dataclass
class _DhState:
    """Where the hidden gradient accumulates over vocabulary blocks, and how."""

    out: torch.Tensor  # the result (input dtype, or fp32 when asked)
    acc: torch.Tensor  # running sum: fp32, or the high part (the output's buffer) when split
    lo: torch.Tensor  # the low part when split (else == acc)
    split: bool
    cublas: bool
    sum_lo: int = 0  # SUM_LO of the kernels


def _sum_layout(
    dtype: torch.dtype, steps: int, fp32_out: bool, cublas: bool, fmt: str
) -> tuple[torch.dtype | None, int]:
    """(dtype of the running sum's own buffer, or None when it needs none; SUM_LO)."""
    if fp32_out or dtype == torch.float32 or (steps == 1 and not cublas):
        return None, 0  # the output is the sum, or one block writes it directly
    if cublas:
        return torch.float32, 0
    if fmt == "fp32":
        return torch.int16, 16
    if fmt == "fp24":
        return torch.int8, 8
    return (dtype, 0) if dtype == torch.bfloat16 else (torch.float32, 0)


def _dh_state(
    n: int,
    h: int,
    dtype: torch.dtype,
    dev: torch.device,
    layout: tuple[torch.dtype | None, int],
    fp32_out: bool,
    cublas: bool,
    spare: SpareRows | None = None,
) -> _DhState:
    """The output and the running sum's buffers; ``spare`` lends the sum dW's last rows."""
    out = torch.empty((n, h), dtype=torch.float32 if fp32_out else dtype, device=dev)
    kind, sum_lo = layout
    if kind is None:
        return _DhState(out, out, out, False, False)
    buf = spare.take(kind) if spare is not None else torch.empty((n, h), dtype=kind, device=dev)
    if kind == torch.float32:
        return _DhState(out, buf, buf, False, cublas)
    hi = out.view(torch.int16) if sum_lo else out  # packed formats keep raw bits in the output
    return _DhState(out, hi, buf, True, False, sum_lo)


@dataclass
class SpareRows:
    """dW's last rows, lent as the hidden-gradient sum's buffer until every block has added to it.

    ``first`` is the first row lent (``v`` while nothing is): rows from there on are written only
    after the sum is final, from their logits recomputed once more.
    """

    dw: torch.Tensor
    n: int
    first: int

    @staticmethod
    def need_rows(dw: torch.Tensor, n: int, kind: torch.dtype) -> int | None:
        """First row of the smallest 16-byte aligned tail of dW that holds ``[n, H]`` of ``kind``."""
        v, h = dw.shape
        row_bytes = h * dw.element_size()
        need = n * h * kind.itemsize
        first = v - math.ceil(need / row_bytes)
        while first > 0 and (first * row_bytes) % 16:
            first -= 1
        if first < 0 or (first * row_bytes) % 16 or dw.data_ptr() % 16:
            return None
        return first

    def take(self, kind: torch.dtype) -> torch.Tensor:
        """The ``[n, H]`` view of ``kind`` over rows ``first`` on (found by ``need_rows``)."""
        h = self.dw.shape[1]
        count = self.n * h * kind.itemsize // self.dw.element_size()
        flat = self.dw.view(-1)[self.first * h : self.first * h + count]
        return flat.view(kind).view(self.n, h)


def _sum_descriptors(st: _DhState, cfg: TileConfig) -> tuple[Any, Any, Any]:
    """TMA descriptors of the dh sum's buffers and output, in the epilogue's column slices."""
    desc = _tensor_descriptor()
    block = [cfg.block_m, cfg.block_n // _epilogue_splits(cfg)]
    return tuple(desc.from_tensor(t, block) for t in (st.acc, st.lo, st.out))  # type: ignore[return-value]


def _row_quantum(h: int, esize: int) -> int:
    """dW rows whose start is 16-byte aligned are the multiples of this."""
    return 16 // math.gcd(16, h * esize)


def backward_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    sc: HeadScalars,
    dz_cfg: TileConfig,
    dh_cfg: TileConfig,
    *,
    need_dh: bool,
    need_dw: bool,
    dh_fp32: bool,
    block_bytes: int | None,
    block_max_cols: int = 8192,
    dh_gemm: str = "auto",
    stash_dh_sum: bool = True,
    dh_sum: str = "auto",
    lend_dw_rows: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dh, dW) by vocabulary blocks: dz kernel, then dW[block] by cuBLAS, dh += dz @ W[block].

    The dh sum runs in the schedule's fixed block order, in fp32 (Triton kernel, or cuBLAS with
    an fp32 C when ``dh_gemm`` asks for it and this torch has it) or split in two parts
    (``dh_sum``: ``SUM_FORMATS``; ``"auto"``: fp24 when stashed, else exact fp32). ``"auto"``
    GEMM takes Triton for bf16, and cuBLAS for fp16 while its fp32 accumulator is at most
    ``AUTO_CUBLAS_ACC_BYTES``.
    ``stash_dh_sum`` keeps that sum's own buffer in dW's last rows (``SpareRows``); once the sum
    is final those rows' dz blocks are recomputed and their dW written. ``lend_dw_rows`` puts dz
    blocks in dW rows not yet written (``schedule``).
    ``block_bytes`` bounds the dz block buffer (None: ``BLOCK_BYTES_LENT`` where dW's rows are lent
    and the sum stashed, else ``BLOCK_BYTES``). ``dh_fp32`` returns dh in fp32 (for a cross-rank sum before rounding).
    """
    _, bwd = kernels()
    n, h = hidden.shape
    v = weight.shape[0]
    dtype = hidden.dtype
    dev = hidden.device
    if not (need_dh or need_dw):
        return None, None
    dw = torch.empty((v, h), dtype=dtype, device=dev) if need_dw else None
    if v == 0:
        dh0 = torch.zeros((n, h), dtype=torch.float32 if dh_fp32 else dtype, device=dev)
        return (dh0 if need_dh else None), dw

    align = math.lcm(dz_cfg.block_n, dh_cfg.block_k)
    esize = hidden.element_size()
    if block_bytes is None:
        block_bytes = default_block_bytes(lend_dw_rows, stash_dh_sum, need_dw, need_dh)
    buffer_cols = vocab_block(n, v, esize, block_bytes, align, block_max_cols)
    geom = schedule.Geometry(
        n, h, v, align, buffer_cols, max(block_max_cols // align * align, align),
        _row_quantum(h, esize),
    )  # fmt: skip
    use_cublas = (
        need_dh
        and (
            dh_gemm == "cublas"
            or (dh_gemm == "auto" and dtype == torch.float16 and n * h * 4 <= AUTO_CUBLAS_ACC_BYTES)
        )
        and dtype != torch.float32
        and cublas_fp32_out_available(dev)
    )
    fmt = ("fp24" if stash_dh_sum else "fp32") if dh_sum == "auto" else dh_sum
    stash_ok = stash_dh_sum and need_dh and dw is not None

    def make_plan(stash: int | None) -> list[schedule.Step]:
        return schedule.plan(
            geom, need_dw=need_dw, need_dh=need_dh, stash=stash, lend_rows=lend_dw_rows
        )

    steps = make_plan(None)
    layout = _sum_layout(dtype, sum(s.add_dh for s in steps), dh_fp32, use_cublas, fmt)
    spare = None
    if stash_ok and layout[0] is not None:
        assert dw is not None
        first = SpareRows.need_rows(dw, n, layout[0])
        if first is not None:
            spare = SpareRows(dw, n, first)
            steps = make_plan(first)
    st = _dh_state(n, h, dtype, dev, layout, dh_fp32, use_cublas, spare) if need_dh else None
    dh_steps = [i for i, s in enumerate(steps) if s.add_dh]
    # rows of a buffer block keep its aligned stride (also for a narrower block): TMA-ready
    buf_cols = min(buffer_cols, math.ceil(v / align) * align)
    dz_buf: torch.Tensor | None = None

    softcap, inv_softcap = sc.softcap_args
    dummy = lse
    dz_tma = tma_usable(dz_cfg, dtype, h, dev)
    dh_tma = st is not None and not st.cublas and tma_usable(dh_cfg, dtype, h, dev)
    if dz_tma or dh_tma:
        desc = _tensor_descriptor()
        w_tma = _tma_ready(weight)
        nprog = _num_programs(dev)
    if dz_tma:
        hd = desc.from_tensor(_tma_ready(hidden), [dz_cfg.block_m, dz_cfg.block_k])
    dz_flags = dict(
        BLOCK_M=dz_cfg.block_m,
        BLOCK_N=dz_cfg.block_n,
        BLOCK_K=dz_cfg.block_k,
        GROUP_M=dz_cfg.group_m,
        PRECISION=_precision(dtype),
        PER_TOKEN_T=temp is not None,
        HAS_SOFTCAP=sc.softcap is not None,
        HAS_GLP=g_lp is not None,
        HAS_GENT=g_ent is not None,
        num_warps=dz_cfg.num_warps,
        num_stages=dz_cfg.num_stages,
    )
    row_args = (
        labels, temp if temp is not None else dummy, lse, ent if ent is not None else dummy,
        g_lp if g_lp is not None else dummy, g_ent if g_ent is not None else dummy,
    )  # fmt: skip

    def dz_storage(step: schedule.Step) -> torch.Tensor:
        """The block's ``[n, cols]`` dz: in dW rows from ``dz_row`` on, or in the buffer."""
        nonlocal dz_buf
        if step.dz_row is not None and dw is not None:
            start = step.dz_row * h
            flat = dw.view(-1)[start : start + n * step.stride]
            return flat.view(n, step.stride)[:, : step.cols]
        if dz_buf is None:
            dz_buf = torch.empty((n, buf_cols), dtype=dtype, device=dev)
        return dz_buf[:, : step.cols]

    def dz_block(step: schedule.Step) -> torch.Tensor:
        """dz for vocabulary rows [v0, v0 + cols)."""
        v0, cols = step.v0, step.cols
        dz = dz_storage(step)
        wb = weight[v0 : v0 + cols]
        tiles = math.ceil(n / dz_cfg.block_m) * math.ceil(cols / dz_cfg.block_n)
        if dz_tma:
            wd = desc.from_tensor(w_tma[v0 : v0 + cols], [dz_cfg.block_n, dz_cfg.block_k])
            zd = desc.from_tensor(dz, [dz_cfg.block_m, dz_cfg.block_n])
            bwd.bwd_dz_tma_kernel[(min(nprog, tiles),)](
                hd, wd, zd, *row_args, n, cols, h, sc.label_offset + v0, sc.ignore_index,
                sc.inv_temp, softcap, inv_softcap, NUM_PROGS=nprog, **dz_flags,
            )  # fmt: skip
        else:
            bwd.bwd_dz_kernel[(tiles,)](
                hidden, wb, *row_args, dz, n, cols, h, hidden.stride(0), hidden.stride(1),
                wb.stride(0), wb.stride(1), dz.stride(0), sc.label_offset + v0, sc.ignore_index,
                sc.inv_temp, softcap, inv_softcap, EVEN_K=h % dz_cfg.block_k == 0, **dz_flags,
            )  # fmt: skip
        return dz

    sum_descs: tuple[Any, Any, Any] | None = None
    # the sum through descriptors needs 16-byte rows in each of its buffers (fp24's are H bytes)
    tma_sum = dh_cfg.tma_sum and st is not None and (h * st.lo.element_size()) % 16 == 0
    for i, step in enumerate(steps):
        v0, cols = step.v0, step.cols
        dz = dz_block(step)
        wb = weight[v0 : v0 + cols]
        if dw is not None and step.write_dw:
            torch.mm(dz.t(), hidden, out=dw[v0 : v0 + cols])
        if st is None or not step.add_dh:
            continue
        first, last = i == dh_steps[0], i == dh_steps[-1]
        if st.cublas:
            torch.addmm(st.acc, dz, wb, beta=0 if first else 1, out_dtype=torch.float32, out=st.acc)
            if last and st.out is not st.acc:
                st.out.copy_(st.acc)
            continue
        dh_flags = dict(
            BLOCK_M=dh_cfg.block_m,
            BLOCK_N=dh_cfg.block_n,
            BLOCK_K=dh_cfg.block_k,
            GROUP_M=dh_cfg.group_m,
            PRECISION=_precision(dtype),
            FIRST=first,
            LAST=last,
            SPLIT=st.split,
            SUM_LO=st.sum_lo,
            num_warps=dh_cfg.num_warps,
            num_stages=dh_cfg.num_stages,
        )
        dh_tiles = math.ceil(n / dh_cfg.block_m) * math.ceil(h / dh_cfg.block_n)
        if dh_tma:
            zd2 = desc.from_tensor(dz, [dh_cfg.block_m, dh_cfg.block_k])
            wd2 = desc.from_tensor(w_tma[v0 : v0 + cols], [dh_cfg.block_k, dh_cfg.block_n])
            dh_progs = nprog * dh_cfg.programs_per_sm
            if sum_descs is None:
                sum_descs = _sum_descriptors(st, dh_cfg) if tma_sum else (None,) * 3
            bwd.bwd_dh_tma_kernel[(min(dh_progs, dh_tiles),)](
                zd2, wd2, st.acc, st.lo, st.out, *sum_descs, n, h, cols, NUM_PROGS=dh_progs,
                TMA_SUM=tma_sum,
                FLATTEN=dh_cfg.flatten, EPILOGUE_SPLITS=_epilogue_splits(dh_cfg),
                PREFETCH=dh_cfg.prefetch_sum, WARP_SPECIALIZE=dh_cfg.warp_specialize, **dh_flags,
            )  # fmt: skip
        else:
            bwd.bwd_dh_kernel[(dh_tiles,)](
                dz, wb, st.acc, st.lo, st.out, n, h, cols, dz.stride(0), wb.stride(0),
                wb.stride(1), EVEN_K=cols % dh_cfg.block_k == 0, EVEN_N=h % dh_cfg.block_n == 0,
                **dh_flags,
            )  # fmt: skip
    return (st.out if st is not None else None), dw
