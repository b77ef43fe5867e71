"""The weight gradient of a chunked three-GEMM step, summed in fp32 and rounded once.

A policy-loss backend adds ``dz^T h`` of each row chunk into ``dW``. A 16-bit running sum rounds
once per chunk, an error that grows with the chunks (bf16, V = 151936: 2.5e-3 relative over 3
chunks, 2.9e-3 over 9, against 2.3e-3 for one rounding); ``WeightGradSum`` keeps an fp32 sum and
rounds it once. Where the rows come in one chunk, a bf16 gradient is that chunk's one GEMM,
accumulated in fp32 and rounded once by cuBLAS itself, with no fp32 copy. Shared by the ``torch``
and ``triton`` backends; a third-party backend may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

FP32 = torch.float32
BF16 = torch.bfloat16

#: ``addmm_out_dtype_works`` per (device, dtype): a plain dict, which torch.compile reads as a
#: constant (it would trace a ``functools.cache``'d function's body, the trial GEMM included).
_ADDMM_OUT_DTYPE: dict[tuple[torch.device, torch.dtype], bool] = {}


def addmm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` and ``torch.addmm(c, a, b,
    out_dtype=torch.float32, out=c)`` take ``a``, ``b`` of ``dtype`` on ``device``, the latter
    adding into the fp32 ``c`` in place (a trial on 2 x 2 ones, its value read; CUDA with
    torch >= 2.8 has ``aten::mm.dtype`` and ``aten::addmm.dtype_out``)."""
    works = _ADDMM_OUT_DTYPE.get((device, dtype))
    if works is None:
        works = _ADDMM_OUT_DTYPE[(device, dtype)] = _try_addmm_out_dtype(device, dtype)
    return works


def _try_addmm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch.ops.aten.addmm, "dtype_out") or not hasattr(torch.ops.aten.mm, "dtype"):
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        c = torch.mm(a, a, out_dtype=FP32)
        torch.addmm(c, a, a, out_dtype=FP32, out=c)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(c.dtype == FP32 and torch.equal(c, torch.full_like(c, 4.0)))


@contextlib.contextmanager
def fp32_reductions() -> Iterator[None]:
    """bf16 GEMMs that reduce in fp32 only: cuBLAS may otherwise split K and add the parts in
    bf16 (``allow_bf16_reduced_precision_reduction``, on by default), a rounding per part where a
    GEMM over many rows and few outputs is split."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


class WeightGradSum:
    """``dW = sum over chunks of dz^T h`` in fp32, rounded once to the weight's dtype.

    Where ``aten::addmm.dtype_out`` adds in place (``addmm_out_dtype_works``) each chunk's GEMM
    adds into the fp32 sum in its epilogue; elsewhere (the CPU) the chunk's operands are upcast.
    Memory: the fp32 sum (twice a 16-bit weight gradient), and at ``result`` the rounded copy
    (bf16; fp16 keeps the sum until the backward).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self._like = weight
        self._sum: torch.Tensor | None = None
        self._fused = weight.dtype != FP32 and addmm_out_dtype_works(weight.device, weight.dtype)

    def add(
        self, dz: torch.Tensor, h_rows: torch.Tensor, alpha: float = 1.0, *, only: bool = False
    ) -> None:
        """Add one chunk's ``alpha dz^T h_rows`` (``dz`` ``[rows, V]``, ``h_rows`` ``[rows, H]``;
        ``alpha``: 1 / the scale ``dz`` was formed at, ``fusedhead.fp16_range``). ``only``: the
        sum's one chunk, whose bf16 GEMM then gives the result itself (one rounding, as the fp32
        sum's, without the fp32 sum's memory and passes)."""
        a, b = dz.t(), h_rows
        if only and self._sum is None and a.dtype == b.dtype == self._like.dtype == BF16:
            with fp32_reductions():
                self._sum = torch.mm(a, b)
            if alpha != 1.0:
                self._sum.mul_(alpha)
            return
        if self._fused:
            if self._sum is None:
                self._sum = torch.mm(a, b, out_dtype=FP32)
                if alpha != 1.0:
                    self._sum.mul_(alpha)
            else:
                torch.addmm(self._sum, a, b, alpha=alpha, out_dtype=FP32, out=self._sum)
            return
        if a.dtype != FP32:
            a, b = a.float(), b.float()
        if self._sum is None:
            self._sum = torch.mm(a, b)
            if alpha != 1.0:
                self._sum.mul_(alpha)
        else:
            self._sum.addmm_(a, b, alpha=alpha)

    def result(self) -> torch.Tensor:
        """The sum in the weight's dtype (zeros without any chunk); the fp32 sum is let go.

        For an fp16 weight the fp32 sum itself: its true values may lie below fp16's range until
        the upstream (GradScaler) scale lifts them, so the core rounds it once that scale is
        applied (``fusedhead.fp16_range``; the contract allows fp32 gradients of fp16 inputs).
        """
        total, self._sum = self._sum, None
        if total is None:
            return torch.zeros_like(self._like)
        if total.dtype == self._like.dtype or self._like.dtype == torch.float16:
            return total
        return total.to(self._like.dtype)

    @staticmethod
    def rounding_bytes(weight: torch.Tensor) -> int:
        """Bytes ``result`` allocates beside the fp32 sum (0 for an fp32 weight): a chunk
        workspace let go before ``result`` may take as much without raising the peak."""
        return 0 if weight.dtype == FP32 else weight.numel() * weight.element_size()
