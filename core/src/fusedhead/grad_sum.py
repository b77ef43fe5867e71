"""The weight gradient of a chunked three-GEMM step, summed in fp32 and rounded once.

A policy-loss backend adds ``dz^T h`` of each row chunk into ``dW``. A 16-bit running sum rounds
once per chunk, an error that grows with the chunks (bf16, V = 151936: 2.5e-3 relative over 3
chunks, 2.9e-3 over 9, against 2.3e-3 for one rounding); ``WeightGradSum`` keeps an fp32 sum and
rounds it once. Shared by the ``torch`` and ``triton`` backends; a third-party backend may use it.
"""

from __future__ import annotations

import torch

FP32 = torch.float32
#: Row blocks a 16-bit weight's fp32 sum is held in. ``result`` rounds them one at a time and lets
#: each go, so the rounding holds the fp32 sum plus one block's copy, not plus the whole copy.
PARTS = 8

#: ``addmm_out_dtype_works`` per (device, dtype): a plain dict, which torch.compile reads as a
#: constant (it would trace a ``functools.cache``'d function's body, the trial GEMM included).
_ADDMM_OUT_DTYPE: dict[tuple[torch.device, torch.dtype], bool] = {}


def addmm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` adds ``a @ b`` of
    ``dtype`` into the fp32 ``c`` in place on ``device`` (a trial on 2 x 2 ones, its value read;
    CUDA with torch >= 2.8 has ``aten::addmm.dtype_out``)."""
    works = _ADDMM_OUT_DTYPE.get((device, dtype))
    if works is None:
        works = _ADDMM_OUT_DTYPE[(device, dtype)] = _try_addmm_out_dtype(device, dtype)
    return works


def _try_addmm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    c = torch.ones(2, 2, dtype=FP32, device=device)
    try:
        torch.addmm(c, a, a, out_dtype=FP32, out=c)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.equal(c, torch.full_like(c, 3.0)))


class WeightGradSum:
    """``dW = sum over chunks of dz^T h`` in fp32, rounded once to the weight's dtype.

    Where ``aten::addmm.dtype_out`` adds in place (``addmm_out_dtype_works``) each chunk's GEMM
    adds into the fp32 sum in its epilogue; elsewhere (the CPU) the chunk's operands are upcast.
    Memory: the fp32 sum (twice a 16-bit weight gradient) until ``result``.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self._like = weight
        self._parts: list[torch.Tensor] = []
        self._fused = weight.dtype != FP32 and addmm_out_dtype_works(weight.device, weight.dtype)
        v = weight.shape[0]
        step = max(1, -(-v // PARTS)) if weight.dtype != FP32 else max(v, 1)
        self._bounds = [(r0, min(r0 + step, v)) for r0 in range(0, v, step)]

    def add(self, dz: torch.Tensor, h_rows: torch.Tensor) -> None:
        """Add one chunk's ``dz^T h_rows`` (``dz`` ``[rows, V]``, ``h_rows`` ``[rows, H]``)."""
        first = not self._parts
        if first:
            shape = (self._like.shape[1],)
            self._parts = [
                torch.empty((r1 - r0, *shape), dtype=FP32, device=self._like.device)
                for r0, r1 in self._bounds
            ]
        a, b = dz.t(), h_rows
        if not self._fused and a.dtype != FP32:
            a, b = a.float(), b.float()
        beta = 0 if first else 1  # beta 0: the empty sum's contents are never read
        for (r0, r1), part in zip(self._bounds, self._parts, strict=True):
            if self._fused:
                torch.addmm(part, a[r0:r1], b, beta=beta, out_dtype=FP32, out=part)
            else:
                torch.addmm(part, a[r0:r1], b, beta=beta, out=part)

    def result(self) -> torch.Tensor:
        """The sum in the weight's dtype (zeros without any chunk); the fp32 sum is let go."""
        parts, self._parts = self._parts, []
        if not parts:
            return torch.zeros_like(self._like)
        if self._like.dtype == FP32:
            return parts[0]
        rounded = []
        while parts:
            rounded.append(parts.pop(0).to(self._like.dtype))  # each fp32 block freed once rounded
        return torch.cat(rounded) if len(rounded) > 1 else rounded[0]
