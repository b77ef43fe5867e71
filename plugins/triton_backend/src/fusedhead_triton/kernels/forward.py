"""Forward kernels: per-tile softmax statistics of ``h @ W.T``, then a fixed-order row combine.

Workspace layout ``ws[3, T, N]`` (fp32): for vocabulary tile ``t`` and row ``n``, ``m`` (tile max
of z), ``s`` (sum of exp(z - m)) and ``w`` (sum of exp(z - m) * (z - m)). Keeping ``w`` relative
to the tile max avoids the cancellation of ``lse - sum(p * z)`` when logits are large. The label
logit is written to ``zy[N]`` by the one tile that holds it (no race, no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, grouped_tile, logits_tile, logits_tile_tma, row_inv_temperature, tanh_f32


@triton.jit
def _stats_epilogue(
    acc,
    offs_m,
    offs_n,
    pid_n,
    N,
    V,
    labels_ptr,
    temp_ptr,
    ws_ptr,
    zy_ptr,
    label_offset,
    inv_temp,
    softcap,
    inv_softcap,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Turn a raw logits tile into (m, s, w) per row and the label logit if the tile holds it."""
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    col_ok = offs_n < V
    inv_t = row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T)
    if HAS_SOFTCAP:
        acc = softcap * tanh_f32(acc * inv_softcap)
    z = acc * inv_t[:, None]
    z = tl.where(col_ok[None, :], z, float("-inf"))
    m = tl.max(z, axis=1)
    d = z - m[:, None]
    e = tl.exp2(d * LOG2E)  # masked columns: exp2(-inf) = 0
    s = tl.sum(e, axis=1)
    w = tl.sum(e * tl.where(col_ok[None, :], d, 0.0), axis=1)

    stat_stride = tl.cdiv(V, BLOCK_N).to(tl.int64) * N
    base = ws_ptr + pid_n.to(tl.int64) * N + offs_m
    tl.store(base, m, mask=row_ok)
    tl.store(base + stat_stride, s, mask=row_ok)
    tl.store(base + 2 * stat_stride, w, mask=row_ok)

    lab = tl.load(labels_ptr + rows) - label_offset
    tile_start = pid_n * BLOCK_N
    hit = row_ok & (lab >= tile_start) & (lab < tile_start + BLOCK_N) & (lab < V)
    col = tl.where(hit, lab - tile_start, -1).to(tl.int32)  # int32 compare per element
    zy = tl.sum(tl.where(tl.arange(0, BLOCK_N)[None, :] == col[:, None], z, 0.0), axis=1)
    tl.store(zy_ptr + rows, zy, mask=hit)


@triton.jit(do_not_specialize=["N", "V"])
def fwd_stats_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    temp_ptr,
    ws_ptr,
    zy_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    label_offset,
    inv_temp,
    softcap,
    inv_softcap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One program per (row tile, vocab tile): fp32 logits tile, then its softmax statistics."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), tl.cdiv(V, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, N - 1)
    cols = tl.minimum(offs_n, V - 1)
    acc = logits_tile(
        h_ptr, w_ptr, rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
    )  # fmt: skip
    _stats_epilogue(
        acc, offs_m, offs_n, pid_n, N, V, labels_ptr, temp_ptr, ws_ptr, zy_ptr, label_offset,
        inv_temp, softcap, inv_softcap, BLOCK_N, PER_TOKEN_T, HAS_SOFTCAP,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N", "V"])
def fwd_stats_tma_kernel(
    h_desc,
    w_desc,
    labels_ptr,
    temp_ptr,
    ws_ptr,
    zy_ptr,
    N,
    V,
    H,
    label_offset,
    inv_temp,
    softcap,
    inv_softcap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Persistent variant: NUM_PROGS programs walk the same tiles, loading through TMA."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = logits_tile_tma(
            h_desc,
            w_desc,
            pid_m * BLOCK_M,
            pid_n * BLOCK_N,
            H,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
        )
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _stats_epilogue(
            acc, offs_m, offs_n, pid_n, N, V, labels_ptr, temp_ptr, ws_ptr, zy_ptr, label_offset,
            inv_temp, softcap, inv_softcap, BLOCK_N, PER_TOKEN_T, HAS_SOFTCAP,
        )  # fmt: skip


@triton.jit(do_not_specialize=["N", "T"])
def combine_kernel(
    ws_ptr,
    zy_ptr,
    labels_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    N,
    T,
    ignore_index,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FINAL: tl.constexpr,
    HAS_ENT: tl.constexpr,
):
    """Combine the T partial stats of each row in a fixed order (max pass, then a sum pass).

    FINAL: write log_prob, lse and entropy (ignored rows give 0). Otherwise write the row's
    combined (m, s, w), the partial a vocab-parallel rank contributes to the all-gather.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    stat_stride = T.to(tl.int64) * N
    big_m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        mask = (tt < T)[:, None] & row_ok[None, :]
        off = tt.to(tl.int64)[:, None] * N + rows[None, :]
        m = tl.load(ws_ptr + off, mask=mask, other=float("-inf"))
        big_m = tl.maximum(big_m, tl.max(m, axis=0))
    safe_m = tl.where(big_m > float("-inf"), big_m, 0.0)  # no live tile: keep the math finite
    big_s = tl.zeros((BLOCK_R,), tl.float32)
    big_w = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        mask = (tt < T)[:, None] & row_ok[None, :]
        off = tt.to(tl.int64)[:, None] * N + rows[None, :]
        m = tl.load(ws_ptr + off, mask=mask, other=float("-inf"))
        s = tl.load(ws_ptr + stat_stride + off, mask=mask, other=0.0)
        w = tl.load(ws_ptr + 2 * stat_stride + off, mask=mask, other=0.0)
        live = m > float("-inf")
        dm = tl.where(live, m - safe_m[None, :], 0.0)
        scale = tl.where(live, tl.exp2(dm * LOG2E), 0.0)
        big_s += tl.sum(s * scale, axis=0)
        big_w += tl.sum((w + dm * s) * scale, axis=0)
    if FINAL:
        big_s = tl.where(row_ok, big_s, 1.0)  # rows past N: keep the math finite
        log_s = tl.log(big_s)
        lse = big_m + log_s
        zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
        lab = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)
        valid = lab != ignore_index
        tl.store(out0_ptr + rows, tl.where(valid, zy - lse, 0.0), mask=row_ok)
        tl.store(out1_ptr + rows, lse, mask=row_ok)
        if HAS_ENT:
            tl.store(out2_ptr + rows, tl.where(valid, log_s - big_w / big_s, 0.0), mask=row_ok)
    else:
        tl.store(out0_ptr + rows, big_m, mask=row_ok)
        tl.store(out1_ptr + rows, big_s, mask=row_ok)
        tl.store(out2_ptr + rows, big_w, mask=row_ok)
