"""The backward's first kernel: recompute a vocabulary block of logits and write its ``dz``.

``dz`` is the gradient w.r.t. the raw logits ``h @ W.T`` of the block (temperature and softcap
derivative folded in), computed in fp32 and stored in the input dtype for the two GEMMs after it.

Heads past the log-prob (lse, sum of squared p, gathered and top-k log-probs) add, behind
constexpr flags, per-row terms ``p (ax + c p)`` and sparse terms at the sorted caller ids
(``sparse.add_sparse``), all in fp32 before the one rounding.
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
from .sparse import add_sparse, tile_bounds


@triton.jit
def _grad_tile(
    acc,
    offs_m,
    offs_n,
    N,
    Vb,
    labels_ptr,
    temp_ptr,
    norm_ptr,
    lp_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    ax_ptr,
    c_ptr,
    sids_ptr,
    gs_ptr,
    sp_lo,
    sp_hi,
    K_sp,
    col0,
    label_offset,
    ignore_index,
    inv_temp,
    softcap,
    inv_softcap,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    HAS_AX: tl.constexpr,
    HAS_C: tl.constexpr,
    HAS_SPARSE: tl.constexpr,
):
    """dz = [g_lp (onehot - p) - g_H p (log p + H)] / T * (1 - tanh^2 if softcap), ignored rows
    exactly 0 (whatever their hidden row holds).

    Per-row factors are folded first so that each element costs a few FMAs and one exp2.
    """
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    inv_t = row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T)
    row_max = tl.load(norm_ptr + rows)
    log_s = tl.load(norm_ptr + N + rows)
    lab = tl.load(labels_ptr + rows)
    valid = row_ok & (lab != ignore_index)
    # label column inside this block as int32 (-1 when outside: never matches a column)
    lab_local = lab - label_offset
    lab_local = tl.where((lab_local >= 0) & (lab_local < Vb), lab_local, -1).to(tl.int32)
    if HAS_GLP:  # noqa: SIM108 - constexpr branch
        glp = tl.where(valid, tl.load(glp_ptr + rows), 0.0) * inv_t
    else:
        glp = tl.zeros_like(inv_t)
    if HAS_GENT:
        gent = tl.where(valid, tl.load(gent_ptr + rows), 0.0) * inv_t
        base = glp + gent * tl.load(ent_ptr + rows)
    else:
        gent = tl.zeros_like(inv_t)
        base = glp
    if HAS_AX:  # the extras' p-proportional terms: dz += ax p
        base = base - tl.where(valid, tl.load(ax_ptr + rows), 0.0) * inv_t
    if HAS_SOFTCAP:
        dcap = sech2_f32(acc * inv_softcap)  # d tanh, exact where the cap saturates
        acc = softcap * tanh_f32(acc * inv_softcap)
    # (z - max) - log s: exact where z is the max, never z - lse (an ulp of the max)
    logp = (acc * inv_t[:, None] - row_max[:, None]) - log_s[:, None]
    p = tl.exp2(logp * LOG2E)
    if HAS_GENT:  # noqa: SIM108 - constexpr branch
        g = -p * (base[:, None] + gent[:, None] * logp)
    else:
        g = -p * base[:, None]
    if HAS_C:  # sum of squared p: dz += c p^2
        cc = tl.where(valid, tl.load(c_ptr + rows), 0.0) * inv_t
        g = g + cc[:, None] * (p * p)
    if HAS_GLP:
        # The label column per row from the forward's log-prob (the same bits as the outputs).
        lp = tl.load(lp_ptr + rows)
        p_y = tl.exp2(lp * LOG2E)
        if HAS_GENT:  # noqa: SIM108 - constexpr branch
            g_y = -p_y * (base + gent * lp)
        else:
            g_y = -p_y * base
        if HAS_C:
            g_y = g_y + cc * (p_y * p_y)
        g = tl.where(offs_n[None, :] == lab_local[:, None], (g_y + glp)[:, None], g)
    if HAS_SPARSE:
        g = add_sparse(g, offs_n, rows, row_ok, sp_lo, sp_hi, col0, sids_ptr, gs_ptr, K_sp, inv_t)
    if HAS_SOFTCAP:
        g = g * dcap
    # Selected, not multiplied: an ignored row's logits (and norm) may be NaN or inf, 0 * NaN is NaN.
    return tl.where(valid[:, None], g, 0.0)


@triton.jit(do_not_specialize=["N", "Vb", "K_sp", "col0"])
def dz_kernel(
    h, w, dz, labels_ptr, temp_ptr, norm_ptr, lp_ptr, ent_ptr, glp_ptr, gent_ptr, ax_ptr, c_ptr,
    starts_ptr, sids_ptr, gs_ptr, N, Vb, H, stride_hn, stride_hk, stride_wv, stride_wk,
    stride_dzm, label_offset, ignore_index, inv_temp, softcap, inv_softcap, K_sp, col0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr, HAS_AX: tl.constexpr, HAS_C: tl.constexpr, HAS_SPARSE: tl.constexpr,
):  # fmt: skip
    """Persistent: NUM_PROGS programs walk the (row tile, column tile) grid of the block
    ``w[0:Vb]``, recomputing each logits tile and writing its dz. ``h``/``w``/``dz`` are TMA
    descriptors when ``TMA`` (strides unused; the store clipped at the edges), else pointers."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(Vb, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        b_rows = tl.minimum(off_m + tl.arange(0, BLOCK_M), N - 1)
        sp_lo, sp_hi = tile_bounds(starts_ptr, pid_n, b_rows, N, HAS_SPARSE)
        if TMA:
            acc = logits_tile_tma(h, w, off_m, off_n, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        else:
            cols = tl.minimum(off_n + tl.arange(0, BLOCK_N), Vb - 1)
            acc = logits_tile(
                h, w, b_rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
            )  # fmt: skip
        # the tile's indices after the K loop: none of them held in registers across it
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        g = _grad_tile(
            acc, offs_m, offs_n, N, Vb, labels_ptr, temp_ptr, norm_ptr, lp_ptr, ent_ptr, glp_ptr,
            gent_ptr, ax_ptr, c_ptr, sids_ptr, gs_ptr, sp_lo, sp_hi, K_sp, col0, label_offset,
            ignore_index, inv_temp, softcap, inv_softcap, PER_TOKEN_T, HAS_SOFTCAP, HAS_GLP,
            HAS_GENT, HAS_AX, HAS_C, HAS_SPARSE,
        )  # fmt: skip
        store_tile(dz, g, off_m, off_n, N, Vb, stride_dzm, BLOCK_M, BLOCK_N, TMA)
