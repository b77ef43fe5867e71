"""Policy-loss kernels: the logits tile with its statistics *and* kept, then ``dz`` from it.

``policy_logits_kernel`` is the forward's persistent logits GEMM (same tiles, same epilogue
statistics ``ws[3, T, N]`` and label logit ``zy[N]``, so the fixed-order combine gives the very
log-probs and entropies of the plain head) whose epilogue also stores each tile's offsets
``d = z - m_tile`` into ``keep[N, V]``. ``policy_dz_kernel`` turns them into the logits' gradient
``dz = dL/dx`` in place (``keep`` and ``dz`` share one buffer; with a softcap ``dz`` fills the
first half of each fp32 row's bytes), for the two gradient GEMMs. ``d <= 0`` and
``p = exp(d + (m_tile - m) - log s) <= exp(d)``, so storing ``d`` in fp16 costs at most ``p |d| 2^-11 <= 2^-11 / e`` of a probability. With a softcap the raw fp32 logit is
kept instead, and ``dz`` recomputes ``z`` from it (the forward's bits) and the cap's derivative
``sech^2`` exactly where the cap saturates: rebuilt from a rounded ``z`` (``1 - tanh^2``) it lost
its digits there (fp16, cap 1: gradients 1.8e-2 to 6.5e-2 from float64, the torch backend's
5e-4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E,
    grouped_tile,
    logits_tile,
    logits_tile_tma,
    row_inv_temperature,
    sech2_f32,
    store_tile,
    tanh_f32,
)
from .forward import label_column, scaled_tile

#: The lowest offset kept (fp16 holds it exactly; exp of it is 0 in fp32).
KEEP_FLOOR = tl.constexpr(-32768.0)


@triton.jit(do_not_specialize=["N", "V"])
def policy_logits_kernel(
    h, w, labels_ptr, temp_ptr, ws_ptr, zy_ptr, keep_ptr, N, V, H, stride_hn, stride_hk,
    stride_wv, stride_wk, stride_keep, label_offset, inv_temp, softcap, inv_softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr, KEEP_TMA: tl.constexpr,
):  # fmt: skip
    """Persistent over the (row tile, vocab tile) grid: the fp32 logits tile, its (m, s, w),
    the label logit, and ``d = z - m`` stored in ``keep``'s dtype (through its TMA descriptor
    when ``KEEP_TMA``), issued as soon as ``d`` exists, ahead of the tile's statistics (a step
    at N = 8192 on an H200: 47.2 ms, against 49.3 with the store after them; docs/benchmarks.md).
    With a softcap the raw logit tile goes to ``keep`` (fp32) instead, before it is capped."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        if TMA:
            acc = logits_tile_tma(
                h, w, pid_m * BLOCK_M, pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION
            )
        else:
            b_rows = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), N - 1)
            cols = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), V - 1)
            acc = logits_tile(
                h, w, b_rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
            )  # fmt: skip
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < N
        col_ok = offs_n < V
        rows = tl.minimum(offs_m, N - 1)
        if HAS_SOFTCAP:
            store_tile(
                keep_ptr, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, N, V, stride_keep, BLOCK_M,
                BLOCK_N, KEEP_TMA,
            )  # fmt: skip
        z = scaled_tile(
            acc, rows, offs_n, V, temp_ptr, inv_temp, softcap, inv_softcap, PER_TOKEN_T,
            HAS_SOFTCAP,
        )  # fmt: skip
        m = tl.max(z, axis=1)
        d = z - m[:, None]
        if not HAS_SOFTCAP:
            # kept at -2**15 at most below the tile's max: exp is 0 there in fp32 already, and
            # an fp16 keep of an offset past 65504 (|z| / T past it) would be -inf, then NaN
            store_tile(
                keep_ptr, tl.maximum(d, KEEP_FLOOR), pid_m * BLOCK_M, pid_n * BLOCK_N, N, V,
                stride_keep, BLOCK_M, BLOCK_N, KEEP_TMA,
            )  # fmt: skip
        e = tl.exp2(d * LOG2E)
        s = tl.sum(e, axis=1)
        wsum = tl.sum(e * tl.where(col_ok[None, :], d, 0.0), axis=1)
        stride_t = tl.cdiv(V, BLOCK_N).to(tl.int64) * N
        base = ws_ptr + pid_n.to(tl.int64) * N + offs_m
        tl.store(base, m, mask=row_ok)
        tl.store(base + stride_t, s, mask=row_ok)
        tl.store(base + 2 * stride_t, wsum, mask=row_ok)
        hit, col = label_column(labels_ptr, rows, row_ok, label_offset, pid_n * BLOCK_N, V, BLOCK_N)
        zy = tl.sum(tl.where(tl.arange(0, BLOCK_N)[None, :] == col[:, None], z, 0.0), axis=1)
        tl.store(zy_ptr + rows, zy, mask=hit)


@triton.jit(do_not_specialize=["N", "V"])
def policy_dz_kernel(
    keep_ptr, dz_ptr, ws_ptr, labels_ptr, temp_ptr, m_ptr, logs_ptr, a_ptr, b_ptr, dzy_ptr, N, V,
    stride_keep, stride_dz, label_offset, ignore_index, inv_temp, softcap, inv_softcap,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """``dz = p (a + b log p) / T [* sech^2]``, ``log p = d + (m_tile - m) - log s`` (not
    ``- lse``, whose rounding to an ulp of ``m`` a large p's ``log p`` cannot afford), the label column
    ``dzy / T [* sech^2]`` (the launcher forms it from the row's log-prob: a confident token's
    ``1 - p`` keeps its digits), for ``BLOCK_R`` rows streamed along the vocabulary one GEMM tile
    width at a time (in place: each value is read, then written, by this program); exactly 0 on
    ignored rows (selected). With a softcap ``keep`` holds the raw logits (fp32): ``z`` is
    recomputed as the forward formed it, and the cap's derivative is ``sech2_f32`` of it."""
    offs_m = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    m_row = tl.load(m_ptr + rows)[:, None]
    log_s = tl.load(logs_ptr + rows)[:, None]
    a = tl.load(a_ptr + rows)[:, None]
    b = tl.load(b_ptr + rows)[:, None]
    dzy = tl.load(dzy_ptr + rows)[:, None]
    lab = tl.load(labels_ptr + rows)
    live = (row_ok & (lab != ignore_index))[:, None]
    col_lab = (lab - label_offset)[:, None]
    inv_t = row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T)[:, None]
    keep_rows = keep_ptr + rows.to(tl.int64)[:, None] * stride_keep
    dz_rows = dz_ptr + rows.to(tl.int64)[:, None] * stride_dz
    for t in tl.range(0, tl.cdiv(V, BLOCK_N), num_stages=STAGES):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (offs_n < V)[None, :]
        kept = tl.load(keep_rows + offs_n[None, :], mask=col_ok, other=0.0).to(tl.float32)
        m = tl.load(ws_ptr + t * N + rows)[:, None]
        if HAS_SOFTCAP:  # z = c tanh(x / c) / T, as scaled_tile forms it
            u = kept * inv_softcap
            d = (softcap * tanh_f32(u)) * inv_t - m
        else:
            d = kept
        log_p = d + ((m - m_row) - log_s)
        p = tl.exp2(log_p * LOG2E)
        dz = tl.where(offs_n[None, :] == col_lab, dzy, p * (a + b * log_p))
        dz = dz * inv_t
        if HAS_SOFTCAP:  # dz/dx carries the cap's derivative
            dz = dz * sech2_f32(u)
        dz = tl.where(live & col_ok, dz, 0.0)
        tl.store(
            dz_rows + offs_n[None, :], dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok
        )
