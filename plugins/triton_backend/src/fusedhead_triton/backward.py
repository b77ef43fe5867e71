"""The backward, block by block in the schedule's order: dz, then dW[block] = dz.T @ hidden by
cuBLAS, then dh += dz @ W[block] into the running sum (``sum_format``).

``memory="low"`` (with both gradients asked) keeps the sum's low byte in dW's last rows until the
sum is final, those rows' blocks recomputed at the end, and a 64 MiB dz buffer; ``"fast"`` keeps
the sum's exact low half beside the output and a 256 MiB buffer. dz blocks go in dW's unwritten
rows where they fit either way (``schedule``). The KL's backward (``Dense``) keeps the sum in one
fp32 ``[N, H]`` tensor instead, added to by cuBLAS, in blocks of whole waves of its dz tiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import schedule, sum_format
from .configs import BLOCK_BYTES, LENT_COLS, MAX_COLS, Settings
from .launch import HeadScalars, RowGrads, dh_block, dz_block

#: Writes ``dz[N, cols]`` of vocabulary rows ``[v0, v0 + cols)``: ``fill_dz(v0, dz)``.
FillDz = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class Dense:
    """The dense hidden-gradient sum of a head whose dz tiles are ``block_m x block_n`` on
    ``programs`` persistent programs (the KL's two-head tiles)."""

    block_m: int
    block_n: int
    programs: int


def wave_columns(n: int, d: Dense, esize: int, block_bytes: int) -> tuple[int, int] | None:
    """(align, widest) block columns whose ``ceil(N / block_m) x cols / block_n`` dz tiles are a
    whole number of waves of ``d.programs``, or None where such a block would not fit the buffer
    bound (``block_bytes``, 10 % over allowed) or past twice ``MAX_COLS``. A block of 4096 columns
    at N = 8192 is 15.5 waves of 132 programs: the last wave runs half empty (3 % of the launch)."""
    rows = -(-n // d.block_m)
    align = d.programs // math.gcd(d.programs, rows) * d.block_n
    if align > 2 * MAX_COLS or align * n * esize > 1.1 * block_bytes:
        return None
    return align, max(1, round(MAX_COLS / align)) * align


def _dense_backward(
    hidden: torch.Tensor, weight: torch.Tensor, fill_dz: FillDz, st: Settings, d: Dense,
    *, need_dw: bool, dh_fp32: bool, valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``backward_from`` with the sum in fp32 (``dense``): no low part, so nothing is stashed or
    recomputed, and each block's ``dz @ W[block]`` is one cuBLAS GEMM with an fp32 output."""
    (n, h), v, dtype, dev = hidden.shape, weight.shape[0], hidden.dtype, hidden.device
    dw = torch.empty((v, h), dtype=dtype, device=dev) if need_dw else None
    if v == 0:
        acc = torch.zeros((n, h), dtype=torch.float32, device=dev)
        return (acc if dh_fp32 else acc.to(dtype)), dw
    acc = torch.empty((n, h), dtype=torch.float32, device=dev)  # the first block writes it
    block_bytes = st.block_bytes or BLOCK_BYTES[st.memory]
    cols = wave_columns(n, d, hidden.element_size(), block_bytes)
    align, widest = cols if cols is not None else (d.block_n, MAX_COLS)
    geom = schedule.geometry(n, h, v, hidden.element_size(), align, block_bytes, widest)
    steps = schedule.plan(geom, need_dw=need_dw, need_dh=True, stash=None)
    for i, step, dz in _blocks(hidden, fill_dz, steps, geom, dw, valid):
        _add_product(acc, dz, weight[step.v0 : step.v0 + step.cols], first=i == 0)
    return (acc if dh_fp32 else acc.to(dtype)), dw


def _blocks(
    hidden: torch.Tensor, fill_dz: FillDz, steps: list[schedule.Step], geom: schedule.Geometry,
    dw: torch.Tensor | None, valid: torch.Tensor | None = None,
) -> Iterator[tuple[int, schedule.Step, torch.Tensor]]:  # fmt: skip
    """Each step's ``dz`` (in dW's unwritten rows or the block buffer), filled and its dW rows
    written, as ``(index, step, dz)``: what is left to the caller is the hidden-gradient sum.

    ``valid`` (rows that may carry gradient): the weight GEMMs read the other rows of ``hidden``
    as zeros, selected, not multiplied, so a NaN or inf in an ignored row (dz 0 there) cannot
    reach dW through ``0 * NaN``; one masked ``[N, H]`` copy for the backward."""
    (n, h), dtype, dev = hidden.shape, hidden.dtype, hidden.device
    buffer: torch.Tensor | None = None
    h_dw = hidden
    if dw is not None and valid is not None:
        h_dw = torch.where(valid.unsqueeze(1), hidden, torch.zeros((), dtype=dtype, device=dev))
    for i, step in enumerate(steps):
        v0, cols = step.v0, step.cols
        if step.dz_row is not None and dw is not None:  # in dW's unwritten rows
            flat = dw.view(-1)[step.dz_row * h : step.dz_row * h + n * step.stride]
            dz = flat.view(n, step.stride)[:, :cols]
        else:
            if buffer is None:
                buffer = torch.empty((n, geom.buffer_cols), dtype=dtype, device=dev)
            dz = buffer[:, :cols]
        fill_dz(v0, dz)
        if dw is not None and step.write_dw:
            torch.mm(dz.t(), h_dw, out=dw[v0 : v0 + cols])
        yield i, step, dz


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool) -> None:
    """``acc (+)= a @ b`` in fp32: cuBLAS's fp32 output for 16-bit inputs on CUDA; elsewhere (the
    CPU interpreter's tests) the same exact products, upcast, summed in fp32."""
    beta = 0.0 if first else 1.0
    if a.dtype == torch.float32:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif a.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, a.float(), b.float(), beta=beta, out=acc)


def backward(
    hidden: torch.Tensor, weight: torch.Tensor, rows: RowGrads, sc: HeadScalars, st: Settings,
    *, need_dh: bool, need_dw: bool, dh_fp32: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dh, dW) of the log-prob/entropy head; ``dh_fp32`` returns dh in fp32 (for a cross-rank
    sum before rounding). Ignored rows give exactly zero in both, whatever their hidden holds."""

    def fill_dz(v0: int, dz: torch.Tensor) -> None:
        dz_block(hidden, weight, rows, sc, st.dz, v0, dz)

    return backward_from(
        hidden, weight, fill_dz, st, need_dh=need_dh, need_dw=need_dw, dh_fp32=dh_fp32,
        valid=rows.labels != sc.ignore_index,
    )  # fmt: skip


def backward_from(
    hidden: torch.Tensor, weight: torch.Tensor, fill_dz: FillDz, st: Settings,
    *, need_dh: bool, need_dw: bool, dh_fp32: bool, dense: Dense | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dh, dW) of any head whose logit gradient ``fill_dz`` writes block by block (the
    log-prob head, a KL): the schedule, the dz buffers and the hidden-gradient sum live here.

    ``dense`` (the KL's): the sum in an fp32 ``[N, H]`` buffer that cuBLAS adds each block to,
    and block widths of whole waves of dz tiles where they fit (``Dense``). ``valid``: the rows
    that carry gradient; ``fill_dz`` must write exact zeros in the others (a select, so a NaN or
    inf hidden row stays out), and the weight GEMMs read those rows of ``hidden`` as zeros."""
    (n, h), v, dtype, dev = hidden.shape, weight.shape[0], hidden.dtype, hidden.device
    if dense is not None and need_dh:
        return _dense_backward(
            hidden, weight, fill_dz, st, dense, need_dw=need_dw, dh_fp32=dh_fp32, valid=valid
        )
    dw = torch.empty((v, h), dtype=dtype, device=dev) if need_dw else None
    if v == 0 or not (need_dh or need_dw):
        dh0 = torch.zeros((n, h), dtype=torch.float32 if dh_fp32 else dtype, device=dev)
        return (dh0 if need_dh else None), dw
    low = st.memory == "low" and dw is not None and need_dh
    block_bytes = st.block_bytes or BLOCK_BYTES["low" if low else "fast"]
    align = math.lcm(st.dz.block_n, st.dh.block_k)
    geom = schedule.geometry(
        n, h, v, hidden.element_size(), align, block_bytes, MAX_COLS, LENT_COLS
    )
    steps = schedule.plan(geom, need_dw=need_dw, need_dh=need_dh, stash=None)
    acc = None
    if need_dh:
        fmt, stash = None, None
        if sum_format.split_format(dtype, sum(s.add_dh for s in steps), dh_fp32):
            fmt = "fp32"
            if low and dw is not None:  # fp24 exactly when stashed: one byte a value
                stash = sum_format.stash_row(dw, n * h)
                if stash is not None:
                    fmt = "fp24"
                    steps = schedule.plan(geom, need_dw=need_dw, need_dh=need_dh, stash=stash)
        acc = sum_format.allocate(n, h, dtype, dev, dh_fp32, fmt, stash, dw)
    dh_steps = [i for i, s in enumerate(steps) if s.add_dh]
    for i, step, dz in _blocks(hidden, fill_dz, steps, geom, dw, valid):
        if acc is not None and step.add_dh:
            first, last = i == dh_steps[0], i == dh_steps[-1]
            dh_block(dz, weight, step.v0, acc, st.dh, first=first, last=last)
    return (acc.out if acc is not None else None), dw
