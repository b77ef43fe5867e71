"""KL of two heads: per-chunk statistics of both logit tiles, a fixed-order combine, and ``dz``.

A forward program owns a row tile and a chunk of ``CHUNK`` consecutive vocabulary tiles. For each
tile it computes the student's tile ``h_s @ W_s.T`` and the teacher's ``h_t @ W_t.T`` (the hidden
sizes may differ), scales them (softcap, then ``1 / T`` of each head) and folds into running per-row
statistics: each head's max ``m`` and ``s = sum exp(z - m)``, and the cross term relative to the
maxima, ``w = sum e_c (d_c - d_o)`` with ``d = z - m``, ``c`` the head weighting the direction
(forward: the teacher, reverse: the student) and ``o`` the other one. Then
``KL = w / s_c - log s_c + log s_o``: the maxima cancel exactly, so no large-logit cancellation.
The statistics are kept in base 2 (``z log2(e)``: ``exp2`` of one fused multiply-add a logit, no
separate scaling), the combine turning them back to nats. Only a tile reaching past V masks its
columns. ``part[5, C, N]`` holds the chunks' statistics; the combine reduces them over C in a fixed
order (batch invariant, deterministic). The backward recomputes both tiles and writes the student's
``dz``: ``g (p_s - p_t)`` (forward) or ``g p_s (log p_s - log p_t - KL)`` (reverse), over ``T_s``
and through the softcap's derivative.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LN2,
    LOG2E,
    grouped_tile,
    logits_tile,
    logits_tile_tma,
    row_inv_temperature,
    sech2_f32,
    store_tile,
    tanh_f32,
)

#: The max of an empty set of statistics: finite (``EMPTY - m`` is no NaN), its exp2 exactly 0.
EMPTY = tl.constexpr(-1e38)


@triton.jit
def _capped(acc, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr):
    """``(c tanh(x / c), 1 - tanh^2)`` of the raw tile (the log-prob kernels' order), or ``(x, 0)``;
    the per-row ``log2(e) / T`` is applied by the callers, inside their ``exp2``'s argument."""
    if HAS_SOFTCAP:
        y = acc * inv_softcap
        return softcap * tanh_f32(y), sech2_f32(y)
    return acc, acc * 0.0


@triton.jit
def _both_tiles(
    hs, ws, ht, wt, off_m, off_n, rows, cols, HS, HT, stride_hsn, stride_hsk, stride_wsv,
    stride_wsk, stride_htn, stride_htk, stride_wtv, stride_wtk, softcap_s, inv_softcap_s,
    softcap_t, inv_softcap_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_KS: tl.constexpr,
    EVEN_KT: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    SOFTCAP_S: tl.constexpr, SOFTCAP_T: tl.constexpr,
):  # fmt: skip
    """Both heads' tiles before ``1 / T``: ``(x_s, the student's cap derivative 1 - tanh^2 or 0, x_t)``, fp32.

    One K loop per head (one loop feeding both, at twice the shared memory a stage, was slower
    and no longer fits at 4 stages: docs/benchmarks.md). ``rows``/``cols`` are clamped in range
    (pointer loads); TMA reads past the edges as zero.
    """
    if TMA:
        acc_s = logits_tile_tma(hs, ws, off_m, off_n, HS, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        acc_t = logits_tile_tma(ht, wt, off_m, off_n, HT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        acc_s = logits_tile(
            hs, ws, rows, cols, HS, stride_hsn, stride_hsk, stride_wsv, stride_wsk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_KS, PRECISION,
        )  # fmt: skip
        acc_t = logits_tile(
            ht, wt, rows, cols, HT, stride_htn, stride_htk, stride_wtv, stride_wtk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_KT, PRECISION,
        )  # fmt: skip
    xs, dcap = _capped(acc_s, softcap_s, inv_softcap_s, SOFTCAP_S)
    xt, _ = _capped(acc_t, softcap_t, inv_softcap_t, SOFTCAP_T)
    return xs, dcap, xt


@triton.jit
def _tile_stats(xs, xt, c_s, c_t, col_ok, MASKED: tl.constexpr, REVERSE: tl.constexpr):
    """(m_s, s_s, m_t, s_t, w) of one tile in base 2 (``y = x c``, ``c = log2(e) / T`` > 0 a row);
    ``w`` relative to the tile's own maxima.

    ``max(x) c`` is ``max(x c)`` exactly (rounding is monotone, ``c`` > 0), so each ``exp2`` takes
    one multiply-add, which Triton 3.6-3.9 contract to one instruction (``tl.fma`` spelled out
    compiled to more instructions and registers on triton 3.6). ``MASKED`` (a tile past V) zeroes the columns past V; the offsets
    ``d = y - m`` are formed from the raw tiles (finite there), so no ``-inf - -inf`` arises.
    The cross term is ``sum e_c (d_c - d_o)`` of the two heads' offsets, never of the raw ``y``:
    where a head's logits are large (a small temperature), ``y_c - y_o`` rounds to an ulp of ``y``
    (1.5e-5 at 230), which the maxima then cancel, leaving that error in a KL of a few nats.
    """
    if MASKED:
        m_s = tl.max(tl.where(col_ok[None, :], xs, float("-inf")), axis=1) * c_s
        m_t = tl.max(tl.where(col_ok[None, :], xt, float("-inf")), axis=1) * c_t
    else:
        m_s = tl.max(xs, axis=1) * c_s
        m_t = tl.max(xt, axis=1) * c_t
    d_s = xs * c_s[:, None] - m_s[:, None]
    d_t = xt * c_t[:, None] - m_t[:, None]
    e_s = tl.exp2(d_s)
    e_t = tl.exp2(d_t)
    if MASKED:
        e_s = tl.where(col_ok[None, :], e_s, 0.0)
        e_t = tl.where(col_ok[None, :], e_t, 0.0)
    if REVERSE:  # noqa: SIM108 - constexpr branch
        w = tl.sum(e_s * (d_s - d_t), axis=1)
    else:
        w = tl.sum(e_t * (d_t - d_s), axis=1)
    return m_s, tl.sum(e_s, axis=1), m_t, tl.sum(e_t, axis=1), w


@triton.jit
def _merge(m_s, s_s, m_t, s_t, w, m2_s, s2_s, m2_t, s2_t, w2, REVERSE: tl.constexpr):
    """Two sets of statistics as one. An empty set is ``m = EMPTY``, ``s = w = 0``: finite, so
    its weight ``exp(EMPTY - m)`` is exactly 0 and nothing is NaN."""
    big_s = tl.maximum(m_s, m2_s)
    big_t = tl.maximum(m_t, m2_t)
    d1_s, d2_s = m_s - big_s, m2_s - big_s  # <= 0
    d1_t, d2_t = m_t - big_t, m2_t - big_t
    a1_s, a2_s = tl.exp2(d1_s), tl.exp2(d2_s)  # base 2: the statistics' own
    a1_t, a2_t = tl.exp2(d1_t), tl.exp2(d2_t)
    if REVERSE:  # w is weighted by the student: it rebases with the student's max
        w = a1_s * (w + (d1_s - d1_t) * s_s) + a2_s * (w2 + (d2_s - d2_t) * s2_s)
    else:
        w = a1_t * (w + (d1_t - d1_s) * s_t) + a2_t * (w2 + (d2_t - d2_s) * s2_t)
    return big_s, s_s * a1_s + s2_s * a2_s, big_t, s_t * a1_t + s2_t * a2_t, w


@triton.jit(do_not_specialize=["N", "V"])
def kl_stats_kernel(
    hs, ws, ht, wt, temp_s_ptr, temp_t_ptr, out_ptr, N, V, HS, HT,
    stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv, stride_wtk,
    inv_temp_s, inv_temp_t, softcap_s, inv_softcap_s, softcap_t, inv_softcap_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    CHUNK: tl.constexpr, NUM_PROGS: tl.constexpr, TMA: tl.constexpr, EVEN_KS: tl.constexpr,
    EVEN_KT: tl.constexpr, PRECISION: tl.constexpr, PER_TOKEN_TS: tl.constexpr,
    PER_TOKEN_TT: tl.constexpr, SOFTCAP_S: tl.constexpr, SOFTCAP_T: tl.constexpr,
    REVERSE: tl.constexpr,
):  # fmt: skip
    """Persistent: each (row tile, chunk of CHUNK vocabulary tiles) item writes ``out[5, C, N]``.

    Tiles are folded in vocabulary order, so a row's statistics depend only on its own data and
    the constexpr shapes (batch invariance). ``hs``.. are TMA descriptors when ``TMA``.
    """
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_tiles_n = tl.cdiv(V, BLOCK_N)
    num_chunks = tl.cdiv(num_tiles_n, CHUNK)
    stat_stride = num_chunks.to(tl.int64) * N
    for item in range(tl.program_id(0), num_pid_m * num_chunks, NUM_PROGS):
        pid_m, chunk = grouped_tile(item, num_pid_m, num_chunks, GROUP_M)
        off_m = pid_m * BLOCK_M
        offs_m = off_m + tl.arange(0, BLOCK_M)
        rows = tl.minimum(offs_m, N - 1)
        c_s = row_inv_temperature(temp_s_ptr, rows, inv_temp_s, PER_TOKEN_TS) * LOG2E
        c_t = row_inv_temperature(temp_t_ptr, rows, inv_temp_t, PER_TOKEN_TT) * LOG2E
        m_s = tl.full((BLOCK_M,), EMPTY, tl.float32)
        m_t = tl.full((BLOCK_M,), EMPTY, tl.float32)
        s_s = tl.zeros((BLOCK_M,), tl.float32)
        s_t = tl.zeros((BLOCK_M,), tl.float32)
        w = tl.zeros((BLOCK_M,), tl.float32)
        first = chunk * CHUNK
        for tile_n in range(first, tl.minimum(first + CHUNK, num_tiles_n)):
            off_n = tile_n * BLOCK_N
            offs_n = off_n + tl.arange(0, BLOCK_N)
            cols = tl.minimum(offs_n, V - 1)
            xs, _, xt = _both_tiles(
                hs, ws, ht, wt, off_m, off_n, rows, cols, HS, HT, stride_hsn, stride_hsk,
                stride_wsv, stride_wsk, stride_htn, stride_htk, stride_wtv, stride_wtk, softcap_s,
                inv_softcap_s, softcap_t, inv_softcap_t, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_KS,
                EVEN_KT, PRECISION, TMA, SOFTCAP_S, SOFTCAP_T,
            )  # fmt: skip
            if off_n + BLOCK_N <= V:  # every tile but a last one reaching past V
                t_ms, t_ss, t_mt, t_st, t_w = _tile_stats(xs, xt, c_s, c_t, offs_n < V, False,
                                                          REVERSE)  # fmt: skip
            else:
                t_ms, t_ss, t_mt, t_st, t_w = _tile_stats(xs, xt, c_s, c_t, offs_n < V, True,
                                                          REVERSE)  # fmt: skip
            m_s, s_s, m_t, s_t, w = _merge(
                m_s, s_s, m_t, s_t, w, t_ms, t_ss, t_mt, t_st, t_w, REVERSE
            )
        row_ok = offs_m < N
        base = out_ptr + chunk.to(tl.int64) * N + offs_m
        tl.store(base, m_s, mask=row_ok)
        tl.store(base + stat_stride, s_s, mask=row_ok)
        tl.store(base + 2 * stat_stride, m_t, mask=row_ok)
        tl.store(base + 3 * stat_stride, s_t, mask=row_ok)
        tl.store(base + 4 * stat_stride, w, mask=row_ok)


@triton.jit(do_not_specialize=["N", "C"])
def kl_combine_kernel(
    part_ptr, valid_ptr, kl_ptr, norm_ptr, N, C,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, REVERSE: tl.constexpr,
):  # fmt: skip
    """Reduce the C chunks of each row in a fixed order (the maxima, then the sums): the KL in
    nats (0 where not valid) and ``norm[5, N]`` for the backward: the student's row max of
    ``z log2(e)`` and ``log2 s``, the teacher's, kept apart (their sum, rounded to an ulp of the
    max, would be the size of a confident pair's ``p_s - p_t``), and the cross term's mean
    ``w / s_c`` (base 2): the reverse gradient's ``log p_s - log p_t - KL`` is ``d_s - d_t`` less
    it, with no ``log s`` nor the KL's own rounding in the difference."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    stat_stride = C.to(tl.int64) * N
    big_s = tl.full((BLOCK_R,), EMPTY, tl.float32)
    big_t = tl.full((BLOCK_R,), EMPTY, tl.float32)
    for c0 in range(0, C, BLOCK_T):
        cc = c0 + tl.arange(0, BLOCK_T)
        mask = (cc < C)[:, None] & row_ok[None, :]
        off = cc.to(tl.int64)[:, None] * N + rows[None, :]
        big_s = tl.maximum(big_s, tl.max(tl.load(part_ptr + off, mask=mask, other=EMPTY), axis=0))
        m_t = tl.load(part_ptr + 2 * stat_stride + off, mask=mask, other=EMPTY)
        big_t = tl.maximum(big_t, tl.max(m_t, axis=0))
    s_s = tl.zeros((BLOCK_R,), tl.float32)
    s_t = tl.zeros((BLOCK_R,), tl.float32)
    w = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, C, BLOCK_T):
        cc = c0 + tl.arange(0, BLOCK_T)
        mask = (cc < C)[:, None] & row_ok[None, :]
        off = cc.to(tl.int64)[:, None] * N + rows[None, :]
        # a masked chunk (s = w = 0, max EMPTY) adds exactly 0
        d_s = tl.load(part_ptr + off, mask=mask, other=EMPTY) - big_s[None, :]
        c_ss = tl.load(part_ptr + stat_stride + off, mask=mask, other=0.0)
        d_t = tl.load(part_ptr + 2 * stat_stride + off, mask=mask, other=EMPTY) - big_t[None, :]
        c_st = tl.load(part_ptr + 3 * stat_stride + off, mask=mask, other=0.0)
        c_w = tl.load(part_ptr + 4 * stat_stride + off, mask=mask, other=0.0)
        a_s = tl.exp2(d_s)
        a_t = tl.exp2(d_t)
        s_s += tl.sum(c_ss * a_s, axis=0)
        s_t += tl.sum(c_st * a_t, axis=0)
        if REVERSE:
            w += tl.sum(a_s * (c_w + (d_s - d_t) * c_ss), axis=0)
        else:
            w += tl.sum(a_t * (c_w + (d_t - d_s) * c_st), axis=0)
    s_s = tl.where(row_ok, s_s, 1.0)  # rows past N: keep the math finite
    s_t = tl.where(row_ok, s_t, 1.0)
    log_ss, log_st = tl.log2(s_s), tl.log2(s_t)
    if REVERSE:  # noqa: SIM108 - constexpr branch
        kl = w / s_s - log_ss + log_st
    else:
        kl = w / s_t - log_st + log_ss
    valid = tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0
    tl.store(kl_ptr + rows, tl.where(valid, kl * LN2, 0.0), mask=row_ok)  # base 2 -> nats
    tl.store(norm_ptr + rows, big_s, mask=row_ok)
    tl.store(norm_ptr + N + rows, log_ss, mask=row_ok)
    tl.store(norm_ptr + 2 * N + rows, big_t, mask=row_ok)
    tl.store(norm_ptr + 3 * N + rows, log_st, mask=row_ok)
    tl.store(norm_ptr + 4 * N + rows, w / (s_s if REVERSE else s_t), mask=row_ok)


@triton.jit(do_not_specialize=["N", "Vb"])
def kl_dz_kernel(
    hs, ws, ht, wt, dz, temp_s_ptr, temp_t_ptr, norm_ptr, coef_ptr,
    N, Vb, HS, HT, stride_hsn, stride_hsk, stride_wsv, stride_wsk, stride_htn, stride_htk,
    stride_wtv, stride_wtk, stride_dzm, inv_temp_s, inv_temp_t, softcap_s, inv_softcap_s,
    softcap_t, inv_softcap_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, TMA: tl.constexpr, EVEN_KS: tl.constexpr,
    EVEN_KT: tl.constexpr, PRECISION: tl.constexpr, PER_TOKEN_TS: tl.constexpr,
    PER_TOKEN_TT: tl.constexpr, SOFTCAP_S: tl.constexpr, SOFTCAP_T: tl.constexpr,
    REVERSE: tl.constexpr,
):  # fmt: skip
    """Persistent: the student's ``dz[N, Vb]`` of the block ``ws[0:Vb]`` / ``wt[0:Vb]`` (its
    rows already offset), from both recomputed tiles; rows whose ``coef`` is 0 give exactly 0."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(Vb, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_m, N - 1)
        cols = tl.minimum(offs_n, Vb - 1)
        inv_s = row_inv_temperature(temp_s_ptr, rows, inv_temp_s, PER_TOKEN_TS)
        c_t = row_inv_temperature(temp_t_ptr, rows, inv_temp_t, PER_TOKEN_TT) * LOG2E
        xs, dcap, xt = _both_tiles(
            hs, ws, ht, wt, off_m, off_n, rows, cols, HS, HT, stride_hsn, stride_hsk, stride_wsv,
            stride_wsk, stride_htn, stride_htk, stride_wtv, stride_wtk, softcap_s, inv_softcap_s,
            softcap_t, inv_softcap_t, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_KS, EVEN_KT, PRECISION, TMA,
            SOFTCAP_S, SOFTCAP_T,
        )  # fmt: skip
        coef = tl.load(coef_ptr + rows)
        # log2 of each head's probabilities: (z log2(e) - max) - log2 s, never z - lse
        m_s, log_ss = tl.load(norm_ptr + rows), tl.load(norm_ptr + N + rows)
        m_t, log_st = tl.load(norm_ptr + 2 * N + rows), tl.load(norm_ptr + 3 * N + rows)
        d_s = xs * (inv_s * LOG2E)[:, None] - m_s[:, None]
        d_t = xt * c_t[:, None] - m_t[:, None]
        p_s = tl.exp2(d_s - log_ss[:, None])
        if REVERSE:  # p_s (ln p_s - ln p_t - KL) = p_s ((d_s - d_t) - mean(d_s - d_t)) ln 2
            mean = tl.load(norm_ptr + 4 * N + rows)
            g = p_s * ((d_s - d_t) - mean[:, None]) * (coef * inv_s * LN2)[:, None]
        else:
            g = (p_s - tl.exp2(d_t - log_st[:, None])) * (coef * inv_s)[:, None]
        if SOFTCAP_S:
            g = g * dcap
        g = tl.where((coef != 0.0)[:, None], g, 0.0)
        store_tile(dz, g, off_m, off_n, N, Vb, stride_dzm, BLOCK_M, BLOCK_N, TMA)
