"""The backward's hidden-gradient GEMM: ``dh += dz[N, Kb] @ W[block]`` into the running sum.

Each tile sums its K steps in a fixed order and adds the result to the sum once
(``sum_format.sum_update``); the block order is the schedule's, so the result is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import grouped_tile
from .sum_format import sum_update


@triton.jit(do_not_specialize=["N", "Kb"])
def dh_kernel(
    dz_ptr, w_ptr, hi_ptr, lo_ptr, out_ptr, N, H, Kb, stride_dzm, stride_wv, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, SUM_LO: tl.constexpr,
):  # fmt: skip
    """One program per output tile. The hidden columns are W's contiguous dimension: masked,
    never clamped, so the loads stay vectorised."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_m, N - 1)
    col_ok = offs_n < H
    a_ptrs = dz_ptr + rows.to(tl.int64)[:, None] * stride_dzm + offs_k[None, :]
    b_ptrs = w_ptr + offs_k[:, None] * stride_wv + offs_n[None, :] * stride_wk
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(Kb, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:  # noqa: SIM108 - constexpr branch
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            kmask = offs_k < Kb - k * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & col_ok[None, :], other=0.0)
        part = tl.dot(a, b, part, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wv
    sum_update(part, offs_m, offs_n, N, H, hi_ptr, lo_ptr, out_ptr, FIRST, LAST, SUM_LO)


@triton.jit(do_not_specialize=["N", "Kb"])
def dh_tma_kernel(
    dz_desc, w_desc, hi_ptr, lo_ptr, out_ptr, N, H, Kb,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, PRECISION: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, SUM_LO: tl.constexpr,
):  # fmt: skip
    """Persistent TMA variant (descriptors zero-fill past Kb, N and H). The sum is updated in two
    column halves: a whole 128 x 256 tile's read-modify-write needs more registers than a thread
    has (H200, N = 32768: 4.27 against 4.38 GEMM units)."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(Kb, BLOCK_K)):
            a = dz_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            part = tl.dot(a, b, part, input_precision=PRECISION)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        col = pid_n * BLOCK_N
        if BLOCK_N >= 32:
            half: tl.constexpr = BLOCK_N // 2
            left, right = part.reshape(BLOCK_M, 2, half).permute(0, 2, 1).split()
            offs_n = col + tl.arange(0, half)
            sum_update(left, offs_m, offs_n, N, H, hi_ptr, lo_ptr, out_ptr, FIRST, LAST, SUM_LO)
            offs_n = col + half + tl.arange(0, half)
            sum_update(right, offs_m, offs_n, N, H, hi_ptr, lo_ptr, out_ptr, FIRST, LAST, SUM_LO)
        else:
            offs_n = col + tl.arange(0, BLOCK_N)
            sum_update(part, offs_m, offs_n, N, H, hi_ptr, lo_ptr, out_ptr, FIRST, LAST, SUM_LO)
