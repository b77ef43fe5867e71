"""Forward kernels: per-tile softmax statistics of ``h @ W.T``, then an exact row combine.

Workspace layout ``ws[3, T, N]`` (fp32): for vocabulary tile ``t`` and row ``n``, ``m`` (tile max
of z), ``s`` (sum of exp(z - m)) and ``w`` (sum of exp(z - m) * (z - m)). Keeping ``w`` relative
to the tile max avoids the cancellation of ``lse - sum(p * z)`` when logits are large. The label
logit is written to ``zy[N]`` by the one tile that holds it (no race, no atomics).

The combine (``combine_kernel``) adds the tiles' statistics as fixed-point integers relative to
the row max, so a row's sums depend on the tile grid only, never on the order or grouping of the
tiles: a vocab-parallel rank's sums, added over ranks, are the one-process sums (``finish_kernel``
turns either into the outputs).

Asked-for extras, each behind a constexpr flag (no cost when off): ``q[T, N]`` = sum exp(2 (z - m))
(sum of squared p), ``arg[T, N]`` the tile's lowest column among its maxima (argmax), and the
logits at caller ids (gather), written with the label logit (``sparse.gather_tile``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, grouped_tile, logits_tile, logits_tile_tma, row_inv_temperature, tanh_f32
from .sparse import first_ids, gather_tile, tile_bounds


@triton.jit
def scaled_tile(
    acc, rows, offs_n, V, temp_ptr, inv_temp, softcap, inv_softcap, PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """The scaled logits ``z`` of raw tile ``acc`` (rows ``rows``, columns ``offs_n``): softcap,
    then 1/T, columns past V at -inf. The forward and the top-k recompute share it (same bits)."""
    inv_t = row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T)
    if HAS_SOFTCAP:
        acc = softcap * tanh_f32(acc * inv_softcap)
    z = acc * inv_t[:, None]
    return tl.where((offs_n < V)[None, :], z, float("-inf"))


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
    q_ptr,
    arg_ptr,
    sids_ptr,
    zg_ptr,
    g_lo,
    g_hi,
    g_first,
    K_g,
    label_offset,
    inv_temp,
    softcap,
    inv_softcap,
    BLOCK_N: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_ARG: tl.constexpr,
    HAS_GATHER: tl.constexpr,
):
    """Turn a raw logits tile into (m, s, w) per row and the label logit if the tile holds it
    (and the asked-for extras: q, the tile argmax, the logits at caller ids)."""
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    col_ok = offs_n < V
    z = scaled_tile(
        acc, rows, offs_n, V, temp_ptr, inv_temp, softcap, inv_softcap, PER_TOKEN_T, HAS_SOFTCAP
    )
    tile_start = pid_n * BLOCK_N
    if HAS_GATHER:  # the gathered logits with the label's, before the softmax temporaries exist
        hit, col = label_column(labels_ptr, rows, row_ok, label_offset, tile_start, V, BLOCK_N)
        gather_tile(
            z, rows, row_ok, hit, col, zy_ptr, g_lo, g_hi, g_first, tile_start, sids_ptr, zg_ptr,
            K_g, BLOCK_N,
        )  # fmt: skip
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
    if HAS_Q:
        tl.store(q_ptr + pid_n.to(tl.int64) * N + offs_m, tl.sum(e * e, axis=1), mask=row_ok)
    if HAS_ARG:  # lowest column among the maxima; a NaN logit (a NaN hidden row) ranks lowest
        a = tl.argmax(tl.where(z == z, z, float("-inf")), axis=1, tie_break_left=True).to(tl.int32)
        tl.store(arg_ptr + pid_n.to(tl.int64) * N + offs_m, a, mask=row_ok)
    if not HAS_GATHER:  # every tile, at the end: cheaper than skipping the tiles without one
        hit, col = label_column(labels_ptr, rows, row_ok, label_offset, tile_start, V, BLOCK_N)
        zy = tl.sum(tl.where(tl.arange(0, BLOCK_N)[None, :] == col[:, None], z, 0.0), axis=1)
        tl.store(zy_ptr + rows, zy, mask=hit)


@triton.jit
def label_column(labels_ptr, rows, row_ok, label_offset, tile_start, V, BLOCK_N: tl.constexpr):
    """Which rows' labels fall in this tile, and their column in it (int32, -1 elsewhere)."""
    lab = tl.load(labels_ptr + rows) - label_offset
    hit = row_ok & (lab >= tile_start) & (lab < tile_start + BLOCK_N) & (lab < V)
    return hit, tl.where(hit, lab - tile_start, -1).to(tl.int32)  # int32 compare per element


@triton.jit(do_not_specialize=["N", "V", "K_g"])
def fwd_stats_kernel(
    h, w, labels_ptr, temp_ptr, ws_ptr, zy_ptr, q_ptr, arg_ptr, starts_ptr, sids_ptr, zg_ptr,
    N, V, H, K_g, stride_hn, stride_hk, stride_wv, stride_wk, label_offset, inv_temp, softcap,
    inv_softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_Q: tl.constexpr,
    HAS_ARG: tl.constexpr, HAS_GATHER: tl.constexpr,
):  # fmt: skip
    """Persistent: NUM_PROGS programs walk the (row tile, vocab tile) grid, each tile an fp32
    logits tile, then its softmax statistics. ``h``/``w`` are TMA descriptors when ``TMA``
    (strides unused), else pointers."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        b_rows = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), N - 1)
        g_lo, g_hi = tile_bounds(starts_ptr, pid_n, b_rows, N, HAS_GATHER)
        g_first = first_ids(sids_ptr, b_rows, g_lo, g_hi, K_g, HAS_GATHER)
        if TMA:
            acc = logits_tile_tma(
                h, w, pid_m * BLOCK_M, pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION
            )
        else:
            cols = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), V - 1)
            acc = logits_tile(
                h, w, b_rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
            )  # fmt: skip
        # the tile's indices after the K loop: none of them held in registers across it
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _stats_epilogue(
            acc, offs_m, offs_n, pid_n, N, V, labels_ptr, temp_ptr, ws_ptr, zy_ptr, q_ptr,
            arg_ptr, sids_ptr, zg_ptr, g_lo, g_hi, g_first, K_g, label_offset, inv_temp, softcap,
            inv_softcap, BLOCK_N, PER_TOKEN_T, HAS_SOFTCAP, HAS_Q, HAS_ARG, HAS_GATHER,
        )  # fmt: skip


@triton.jit(do_not_specialize=["N", "T"])
def combine_kernel(
    ws_ptr,
    q_ptr,
    arg_ptr,
    gm_ptr,
    m_out_ptr,
    sums_ptr,
    arg_out_ptr,
    N,
    T,
    label_offset,
    arg_width,
    two_f,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_GM: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_ARG: tl.constexpr,
):
    """Each row's T tile statistics as exact fixed-point sums: the row max ``M`` (over the tiles,
    or ``gm`` when ``HAS_GM``: every rank's), then per tile ``s``, ``w`` (and ``q``) rebased onto
    it, each scaled by ``two_f`` (``2**FIXED_BITS``), truncated to int64 and added as integers.
    Integer sums are exact, so they do not depend on the order or grouping of the tiles (nor on
    which ranks hold them). Writes ``M``, ``sums[4, N]`` (s, w, q, and a count of terms that were
    NaN or inf) and, where asked, the argmax id over these tiles (the first tile holding their
    max, its lowest column; -1 without tiles).
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    stat_stride = T.to(tl.int64) * N
    big_m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    nan_m = tl.zeros((BLOCK_R,), tl.int64)
    best_t = tl.zeros((BLOCK_R,), tl.int32)
    for t0 in range(0, T, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        mask = (tt < T)[:, None] & row_ok[None, :]
        off = tt.to(tl.int64)[:, None] * N + rows[None, :]
        m = tl.load(ws_ptr + off, mask=mask, other=float("-inf"))
        nan_m += tl.sum((m != m).to(tl.int64), axis=0)
        chunk_m = tl.max(m, axis=0)
        if HAS_ARG:  # earlier tiles hold lower ids: keep the first tile reaching the max
            chunk_t = tl.argmax(m, axis=0, tie_break_left=True).to(tl.int32) + t0
            best_t = tl.where(chunk_m > big_m, chunk_t, best_t)
        big_m = tl.maximum(big_m, chunk_m)
    if HAS_ARG:
        has = row_ok & (big_m > float("-inf"))
        col = tl.load(arg_ptr + best_t.to(tl.int64) * N + rows, mask=has, other=0)
        arg = best_t.to(tl.int64) * arg_width + col + label_offset
        tl.store(arg_out_ptr + rows, tl.where(has, arg, -1), mask=row_ok)
    if HAS_GM:
        big_m = tl.load(gm_ptr + rows, mask=row_ok, other=float("-inf"))
    safe_m = tl.where(big_m > float("-inf"), big_m, 0.0)  # no live tile: keep the math finite
    big_s = tl.zeros((BLOCK_R,), tl.int64)
    big_w = tl.zeros((BLOCK_R,), tl.int64)
    big_q = tl.zeros((BLOCK_R,), tl.int64)
    bad = nan_m
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
        on = scale > 0.0  # a tile far below the max adds 0 (never -inf * 0)
        t_s = tl.where(on, s * scale, 0.0) * two_f
        t_w = tl.where(on, (w + dm * s) * scale, 0.0) * two_f
        ok_s = tl.abs(t_s) < float("inf")
        ok_w = tl.abs(t_w) < float("inf")
        bad += tl.sum((~ok_s).to(tl.int64) + (~ok_w).to(tl.int64), axis=0)
        big_s += tl.sum(tl.where(ok_s, t_s, 0.0).to(tl.int64), axis=0)
        big_w += tl.sum(tl.where(ok_w, t_w, 0.0).to(tl.int64), axis=0)
        if HAS_Q:
            q = tl.load(q_ptr + off, mask=mask, other=0.0)
            t_q = tl.where(on, q * (scale * scale), 0.0) * two_f
            ok_q = tl.abs(t_q) < float("inf")
            bad += tl.sum((~ok_q).to(tl.int64), axis=0)
            big_q += tl.sum(tl.where(ok_q, t_q, 0.0).to(tl.int64), axis=0)
    tl.store(m_out_ptr + rows, big_m, mask=row_ok)
    tl.store(sums_ptr + rows, big_s, mask=row_ok)
    tl.store(sums_ptr + N + rows, big_w, mask=row_ok)
    tl.store(sums_ptr + 2 * N + rows, big_q, mask=row_ok)
    tl.store(sums_ptr + 3 * N + rows, bad, mask=row_ok)


@triton.jit(do_not_specialize=["N"])
def finish_kernel(
    m_ptr,
    sums_ptr,
    zy_ptr,
    labels_ptr,
    lp_ptr,
    lse_ptr,
    logs_ptr,
    ent_ptr,
    p2_ptr,
    N,
    ignore_index,
    inv_two_f,
    BLOCK_R: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_Q: tl.constexpr,
):
    """A row's outputs from its row max and fixed-point sums (``combine_kernel``'s, or their sum
    over ranks): log_prob, lse, log s (``lse - m`` unrounded: other ids' log-probs are
    ``(z - m) - log s`` too) and, where asked, entropy and the sum of squared p (ignored rows
    give 0 but in lse and log s; NaN where a summed term was not finite). One
    kernel for the one-process and the vocab-parallel call: the same bits from the same sums."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    big_m = tl.load(m_ptr + rows, mask=row_ok, other=0.0)
    bad = tl.load(sums_ptr + 3 * N + rows, mask=row_ok, other=0) > 0
    big_s = tl.load(sums_ptr + rows, mask=row_ok, other=0).to(tl.float32) * inv_two_f
    big_s = tl.where(row_ok, big_s, 1.0)  # rows past N: keep the math finite
    # s >= 1 wherever the row has a finite max; s = 0 means no tile had one (its logits NaN or
    # -inf: a tile's max passes over NaN where padding columns hold -inf), so NaN, not -inf
    big_s = tl.where(bad | (big_s == 0.0), float("nan"), big_s)
    log_s = tl.log(big_s)
    lse = big_m + log_s
    zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
    lab = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index)
    valid = lab != ignore_index
    # (z_y - m) - log s, not z_y - lse: lse rounds a small log s to an ulp of m (a confident
    # token's log-prob, and its gradient's 1 - p, would lose digits); z_y - m is exact near m.
    tl.store(lp_ptr + rows, tl.where(valid, (zy - big_m) - log_s, 0.0), mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(logs_ptr + rows, log_s, mask=row_ok)
    if HAS_ENT:
        big_w = tl.load(sums_ptr + N + rows, mask=row_ok, other=0).to(tl.float32) * inv_two_f
        tl.store(ent_ptr + rows, tl.where(valid, log_s - big_w / big_s, 0.0), mask=row_ok)
    if HAS_Q:
        big_q = tl.load(sums_ptr + 2 * N + rows, mask=row_ok, other=0).to(tl.float32) * inv_two_f
        tl.store(p2_ptr + rows, tl.where(valid, big_q / (big_s * big_s), 0.0), mask=row_ok)
