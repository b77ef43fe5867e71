"""Pieces shared by the forward and backward kernels: tile order, the logits tile, softcap.

Every value a row gets depends only on the constexpr tile shape and on that row's data: the
tile order below only decides *when* a tile runs, never how it is computed.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a flat program id to (row tile, column tile), GROUP_M row tiles at a time (L2 reuse)."""
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def logits_tile(
    a_ptr,
    b_ptr,
    rows,
    cols,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 tile of ``A[rows] @ B[cols].T`` with a fixed K order; rows/cols must be in range."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def logits_tile_tma(
    a_desc,
    b_desc,
    off_m,
    off_n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Same tile through TMA descriptors (out-of-bounds rows/cols/K read as zero)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def store_tile(
    dst, tile, off_m, off_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """Write an fp32 ``tile`` at ``(off_m, off_n)`` of ``dst [M, N]`` in ``dst``'s dtype: through
    its TMA descriptor (clipped at the edges) when ``TMA``, else masked pointer stores."""
    if TMA:
        dst.store([off_m, off_n], tile.to(dst.dtype))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        ptrs = dst + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :]
        tl.store(ptrs, tile.to(dst.dtype.element_ty), mask=mask)


#: Odd Taylor coefficients of tanh (x, x^3, ..., x^17): below |x| = 0.625 nine terms reach fp32.
_T1 = tl.constexpr(-0.3333333333333333)
_T2 = tl.constexpr(0.13333333333333333)
_T3 = tl.constexpr(-0.05396825396825397)
_T4 = tl.constexpr(0.021869488536155203)
_T5 = tl.constexpr(-0.008863235529902197)
_T6 = tl.constexpr(0.003592128036572481)
_T7 = tl.constexpr(-0.0014558343870513183)
_T8 = tl.constexpr(0.000590027440945586)


@triton.jit
def tanh_f32(x):
    """tanh within a few fp32 ulps (relative) at every |x|, portable (no libdevice).

    ``1 - 2 / (exp(2|x|) + 1)`` cancels at small |x| (all relative precision lost near 0), so
    below |x| = 0.625 an odd polynomial takes over; above it the cancellation costs < 1.2x.
    """
    ax = tl.abs(x)
    # tanh rounds to 1 in fp32 from |x| = 9.02: past 16 the argument is held there, the same
    # bits, and exp2 never overflows (the interpreter's NumPy warned on every such value)
    held = tl.where(ax > 16.0, 16.0, ax)  # a NaN stays NaN (NaN > 16 is false)
    big = 1.0 - 2.0 / (tl.exp2(held * (2.0 * LOG2E)) + 1.0)
    xs = tl.where(ax < 0.625, x, 0.0)  # the polynomial's branch only: x * x never overflows
    x2 = xs * xs
    p = x2 * _T8 + _T7
    p = p * x2 + _T6
    p = p * x2 + _T5
    p = p * x2 + _T4
    p = p * x2 + _T3
    p = p * x2 + _T2
    p = p * x2 + _T1
    small = xs + xs * (x2 * p)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def sech2_f32(x):
    """``1 - tanh(x)^2`` (the softcap's derivative) within a few fp32 ulps (relative) at every |x|.

    ``1 - th * th`` from the rounded tanh cancels as the cap saturates (all relative precision is
    gone once tanh rounds to 1); ``4 e / (1 + e)^2`` with ``e = exp(-2|x|)`` does not, and below
    |x| = 0.625 (``th^2`` <= 0.31) the plain form has no cancellation to lose.
    """
    th = tanh_f32(x)
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))  # in (0, 1]: no overflow
    return tl.where(tl.abs(x) < 0.625, 1.0 - th * th, 4.0 * e / ((1.0 + e) * (1.0 + e)))


@triton.jit
def row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T: tl.constexpr):
    """Per-row 1/T: from the fp32 [N] tensor, or the scalar broadcast."""
    if PER_TOKEN_T:
        return 1.0 / tl.load(temp_ptr + rows)
    else:
        return tl.zeros_like(rows).to(tl.float32) + inv_temp
