"""The two gradient GEMMs of every recomputed tile, written once for each backward walk.

Every backward of the torch backend (the plain head, the outputs past it, the KL of two heads)
recomputes tiles ``[rows, block]`` in the same order: vocabulary blocks outside, row chunks inside.
Each tile's ``dz`` enters ``dh[rows] += dz @ W[block]`` (summed in fp32) and
``dW[block] += dz.T @ h[rows]``. A block's weight gradient is finished before the next block
starts: one GEMM when the rows are one chunk (the GEMM accumulates in fp32), else an fp32
``[block, H]`` buffer sums the chunks; so no ``[V, H]`` fp32 buffer ever exists.
"""

from __future__ import annotations

from typing import Any

import torch

from fusedhead_torch.parallel import all_reduce_sum_

FP32 = torch.float32


class TileGrads:
    """Accumulates ``dh`` and ``dW`` from the ``dz`` of each tile, block by block.

    ``add`` takes one tile's ``dz`` (the dtype of the gradient GEMMs), ``end_block`` finishes the
    block's weight gradient, ``result`` hands back ``dh`` in the input dtype (all-reduced over a
    process group if asked) and ``dW``.
    """

    def __init__(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        row_chunks: int,
        blocks: int,
        need_h: bool,
        need_w: bool,
    ) -> None:
        self._n, self._width, self._dtype, self._device = h.shape[0], h.shape[1], h.dtype, h.device
        self._need_h = need_h
        self._one_chunk = row_chunks == 1
        # One fp32 tile in all: its dh GEMM is the whole dh, no zeros and no add.
        direct = blocks == 1 and row_chunks == 1 and h.dtype == FP32
        self._dh: torch.Tensor | None = None
        if need_h and not direct:
            self._dh = torch.zeros(self._n, self._width, dtype=FP32, device=self._device)
        self._dw: torch.Tensor | None = None
        if need_w:  # every block is written, unless there are no rows at all
            self._dw = torch.empty_like(weight) if row_chunks else torch.zeros_like(weight)
        self._acc: torch.Tensor | None = None

    def add(
        self,
        dz: torch.Tensor,
        w_block: torch.Tensor,
        h_rows: torch.Tensor,
        rows: tuple[int, int],
        cols: tuple[int, int],
    ) -> None:
        """The gradient GEMMs of the tile ``rows x cols`` whose logit gradient is ``dz``."""
        r0, r1 = rows
        if self._need_h:
            if self._dh is None:
                self._dh = torch.mm(dz, w_block)  # the one and only tile, fp32
            else:
                self._dh[r0:r1].add_(torch.mm(dz, w_block))
        if self._dw is not None:
            part = torch.mm(dz.T, h_rows)
            if self._one_chunk:
                self._dw[cols[0] : cols[1]].copy_(part)
            elif self._acc is None:
                self._acc = part.float()
            else:
                self._acc.add_(part)

    def end_block(self, cols: tuple[int, int]) -> None:
        """Write the weight gradient of the block ``cols`` summed over its row chunks."""
        if self._dw is not None and self._acc is not None:
            self._dw[cols[0] : cols[1]].copy_(self._acc)
        self._acc = None

    def result(
        self, group: Any = None, reduce: bool = False
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``dh`` in the input dtype (summed over ``group`` in fp32 when ``reduce``) and ``dW``."""
        dh = self._dh
        if self._need_h and dh is None:  # no tile at all (an empty shard) contributes nothing
            dh = torch.zeros(self._n, self._width, dtype=FP32, device=self._device)
        if dh is not None and dh.numel() and group is not None and reduce:
            all_reduce_sum_(dh, group)  # in fp32, before the cast
        return (None if dh is None else dh.to(self._dtype)), self._dw
