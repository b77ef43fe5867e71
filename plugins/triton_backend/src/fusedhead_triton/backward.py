"""The backward, block by block in the schedule's order: dz, then dW[block] = dz.T @ hidden by
cuBLAS, then dh += dz @ W[block] into the running sum (``sum_format``).

``memory="low"`` (with both gradients asked) keeps the sum's low byte in dW's last rows until the
sum is final, those rows' blocks recomputed at the end, and a 64 MiB dz buffer; ``"fast"`` keeps
the sum's exact low half beside the output and a 256 MiB buffer. dz blocks go in dW's unwritten
rows where they fit either way (``schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import schedule, sum_format
from .configs import BLOCK_BYTES, MAX_COLS, Settings
from .launch import HeadScalars, RowGrads, dh_block, dz_block

#: Writes ``dz[N, cols]`` of vocabulary rows ``[v0, v0 + cols)``: ``fill_dz(v0, dz)``.
FillDz = Callable[[int, torch.Tensor], None]


def backward(
    hidden: torch.Tensor, weight: torch.Tensor, rows: RowGrads, sc: HeadScalars, st: Settings,
    *, need_dh: bool, need_dw: bool, dh_fp32: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dh, dW) of the log-prob/entropy head; ``dh_fp32`` returns dh in fp32 (for a cross-rank
    sum before rounding)."""

    def fill_dz(v0: int, dz: torch.Tensor) -> None:
        dz_block(hidden, weight, rows, sc, st.dz, v0, dz)

    return backward_from(
        hidden, weight, fill_dz, st, need_dh=need_dh, need_dw=need_dw, dh_fp32=dh_fp32
    )


def backward_from(
    hidden: torch.Tensor, weight: torch.Tensor, fill_dz: FillDz, st: Settings,
    *, need_dh: bool, need_dw: bool, dh_fp32: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dh, dW) of any head whose logit gradient ``fill_dz`` writes block by block (the
    log-prob head, a KL): the schedule, the dz buffers and the hidden-gradient sum live here."""
    (n, h), v, dtype, dev = hidden.shape, weight.shape[0], hidden.dtype, hidden.device
    dw = torch.empty((v, h), dtype=dtype, device=dev) if need_dw else None
    if v == 0 or not (need_dh or need_dw):
        dh0 = torch.zeros((n, h), dtype=torch.float32 if dh_fp32 else dtype, device=dev)
        return (dh0 if need_dh else None), dw
    low = st.memory == "low" and dw is not None and need_dh
    block_bytes = st.block_bytes or BLOCK_BYTES["low" if low else "fast"]
    align = math.lcm(st.dz.block_n, st.dh.block_k)
    geom = schedule.geometry(n, h, v, hidden.element_size(), align, block_bytes, MAX_COLS)
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
    buffer: torch.Tensor | None = None
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
            torch.mm(dz.t(), hidden, out=dw[v0 : v0 + cols])
        if acc is not None and step.add_dh:
            dh_block(dz, weight, v0, acc, st.dh, first=i == dh_steps[0], last=i == dh_steps[-1])
    return (acc.out if acc is not None else None), dw
