"""Backward kernels: recompute a vocabulary block of logits and write ``dz``; accumulate ``dh``.

``dz`` is the gradient w.r.t. the raw logits ``h @ W.T`` of one vocabulary block (temperature
and softcap derivative folded in), computed in fp32 and stored in the input dtype for the GEMMs.
``dh`` is accumulated over blocks in a fixed order, in fp32: one fp32 buffer, or split into a high
half (16 bits, kept in the output's own buffer) and a low part (see ``_sum_join``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LOG2E, grouped_tile, logits_tile, logits_tile_tma, row_inv_temperature, tanh_f32


@triton.jit
def _grad_tile(
    acc,
    offs_m,
    offs_n,
    N,
    Vb,
    labels_ptr,
    temp_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    label_offset,
    ignore_index,
    inv_temp,
    softcap,
    inv_softcap,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
):
    """dz = [g_lp (onehot - p) - g_H p (log p + H)] / T * (1 - tanh^2 if softcap), ignored rows 0.

    Per-row factors are folded first so that each element costs a few FMAs and one exp2.
    """
    row_ok = offs_m < N
    rows = tl.minimum(offs_m, N - 1)
    inv_t = row_inv_temperature(temp_ptr, rows, inv_temp, PER_TOKEN_T)
    lse = tl.load(lse_ptr + rows)
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
    if HAS_SOFTCAP:
        th = tanh_f32(acc * inv_softcap)
        acc = softcap * th
    logp = acc * inv_t[:, None] - lse[:, None]
    p = tl.exp2(logp * LOG2E)
    if HAS_GENT:  # noqa: SIM108 - constexpr branch
        g = -p * (base[:, None] + gent[:, None] * logp)
    else:
        g = -p * base[:, None]
    if HAS_GLP:
        g = tl.where(offs_n[None, :] == lab_local[:, None], g + glp[:, None], g)
    if HAS_SOFTCAP:
        g = g * (1.0 - th * th)
    return g


@triton.jit(do_not_specialize=["N", "Vb"])
def bwd_dz_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    temp_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    N,
    Vb,
    H,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    stride_dzm,
    label_offset,
    ignore_index,
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
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
):
    """One program per (row tile, column tile) of the block ``w_ptr[0:Vb]``: recompute, write dz."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BLOCK_M), tl.cdiv(Vb, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, N - 1)
    cols = tl.minimum(offs_n, Vb - 1)
    acc = logits_tile(
        h_ptr, w_ptr, rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
    )  # fmt: skip
    g = _grad_tile(
        acc, offs_m, offs_n, N, Vb, labels_ptr, temp_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
        label_offset, ignore_index, inv_temp, softcap, inv_softcap,
        PER_TOKEN_T, HAS_SOFTCAP, HAS_GLP, HAS_GENT,
    )  # fmt: skip
    mask = (offs_m < N)[:, None] & (offs_n < Vb)[None, :]
    ptrs = dz_ptr + offs_m.to(tl.int64)[:, None] * stride_dzm + offs_n[None, :]
    tl.store(ptrs, g.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "Vb"])
def bwd_dz_tma_kernel(
    h_desc,
    w_desc,
    dz_desc,
    labels_ptr,
    temp_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    N,
    Vb,
    H,
    label_offset,
    ignore_index,
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
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
):
    """Persistent TMA variant of ``bwd_dz_kernel``; dz leaves through a TMA store (clipped)."""
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(Vb, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = logits_tile_tma(h_desc, w_desc, off_m, off_n, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        g = _grad_tile(
            acc, offs_m, offs_n, N, Vb, labels_ptr, temp_ptr, lse_ptr, ent_ptr, glp_ptr,
            gent_ptr, label_offset, ignore_index, inv_temp, softcap, inv_softcap,
            PER_TOKEN_T, HAS_SOFTCAP, HAS_GLP, HAS_GENT,
        )  # fmt: skip
        dz_desc.store([off_m, off_n], g.to(dz_desc.dtype))


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Columns [0, COLS/2) and [COLS/2, COLS) of a [ROWS, COLS] tile."""
    return x.reshape(ROWS, 2, COLS // 2).permute(0, 2, 1).split()


@triton.jit
def _sum_join(hi, lo, SUM_LO: tl.constexpr):
    """The running sum's fp32 value from its two stored parts.

    SUM_LO 16: ``hi``/``lo`` are the top and bottom 16 bits of the fp32 value (exact fp32).
    SUM_LO 8: ``lo`` holds bits 8-15 (a 16-bit significand, rounded). SUM_LO 0: a bf16 pair.
    """
    if SUM_LO == 0:
        return hi.to(tl.float32) + lo.to(tl.float32)
    bits = hi.to(tl.int32) << 16  # sign-extended int16: the shift leaves exactly its 16 bits
    if SUM_LO == 16:  # noqa: SIM108 - constexpr branch
        bits = bits | (lo.to(tl.int32) & 0xFFFF)
    else:
        bits = bits | ((lo.to(tl.int32) & 0xFF) << 8)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _sum_split(total, hi_ty: tl.constexpr, lo_ty: tl.constexpr, SUM_LO: tl.constexpr):
    """(hi, lo) to store for the fp32 running sum ``total`` (the inverse of ``_sum_join``)."""
    if SUM_LO == 0:
        hi = total.to(hi_ty)
        lo = (total - hi.to(tl.float32)).to(lo_ty)
    else:
        bits = total.to(tl.int32, bitcast=True)
        if SUM_LO == 8:
            # round the magnitude to 24 bits (sign-magnitude format); a NaN stays one (quiet
            # bit set: its payload may lie in the dropped bits)
            bits = tl.where(total != total, bits | 0x400000, bits + 0x80)
            lo = (bits >> 8).to(tl.int8)  # integer narrowing keeps the low bits
        else:
            lo = bits.to(tl.int16)
        hi = (bits >> 16).to(tl.int16)
    return hi, lo


@triton.jit
def _dh_store(
    total,
    offs_m,
    offs_n,
    N,
    H,
    acc_ptr,
    lo_ptr,
    out_ptr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
):
    """Store the tile's new running sum (fp32, or split in hi + lo), or the result on the last block."""
    mask = (offs_m < N)[:, None] & (offs_n < H)[None, :]
    idx = offs_m.to(tl.int64)[:, None] * H + offs_n[None, :]
    if LAST:
        tl.store(out_ptr + idx, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if SPLIT:
            hi, lo = _sum_split(total, acc_ptr.dtype.element_ty, lo_ptr.dtype.element_ty, SUM_LO)
            tl.store(acc_ptr + idx, hi, mask=mask)
            tl.store(lo_ptr + idx, lo, mask=mask)
        else:
            tl.store(acc_ptr + idx, total, mask=mask)


@triton.jit
def _dh_update(
    part,
    offs_m,
    offs_n,
    N,
    H,
    acc_ptr,
    lo_ptr,
    out_ptr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
):
    """Add this block's tile to the running dh sum (fp32, or split in hi + lo) or write the result."""
    mask = (offs_m < N)[:, None] & (offs_n < H)[None, :]
    idx = offs_m.to(tl.int64)[:, None] * H + offs_n[None, :]
    if FIRST:
        total = part
    else:
        if SPLIT:
            prev = _sum_join(
                tl.load(acc_ptr + idx, mask=mask, other=0), tl.load(lo_ptr + idx, mask=mask, other=0),
                SUM_LO,
            )  # fmt: skip
        else:
            prev = tl.load(acc_ptr + idx, mask=mask, other=0.0)
        total = prev + part
    _dh_store(total, offs_m, offs_n, N, H, acc_ptr, lo_ptr, out_ptr, LAST, SPLIT, SUM_LO)


@triton.jit
def _dh_update_tma(
    part,
    off_m,
    off_n,
    acc_desc,
    lo_desc,
    out_desc,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
):
    """``_dh_update`` through tensor descriptors: no per-value addresses held in registers,
    edges clipped by the descriptors, stores asynchronous."""
    if FIRST:
        total = part
    else:
        if SPLIT:
            prev = _sum_join(acc_desc.load([off_m, off_n]), lo_desc.load([off_m, off_n]), SUM_LO)
        else:
            prev = acc_desc.load([off_m, off_n])
        total = prev + part
    if LAST:
        out_desc.store([off_m, off_n], total.to(out_desc.dtype))
    else:
        if SPLIT:
            hi, lo = _sum_split(total, acc_desc.dtype, lo_desc.dtype, SUM_LO)
            acc_desc.store([off_m, off_n], hi)
            lo_desc.store([off_m, off_n], lo)
        else:
            acc_desc.store([off_m, off_n], total)


@triton.jit
def _dh_slice(
    part,
    offs_m,
    row0,
    col,
    N,
    H,
    acc_ptr,
    lo_ptr,
    out_ptr,
    acc_desc,
    lo_desc,
    out_desc,
    WIDTH: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
    TMA_SUM: tl.constexpr,
):
    """Update the sum's columns [col, col + WIDTH) of the tile at row ``row0`` (rows ``offs_m``),
    through the descriptors (TMA_SUM) or through pointers."""
    if TMA_SUM:
        _dh_update_tma(part, row0, col, acc_desc, lo_desc, out_desc, FIRST, LAST, SPLIT, SUM_LO)
    else:
        offs_n = col + tl.arange(0, WIDTH)
        _dh_update(part, offs_m, offs_n, N, H, acc_ptr, lo_ptr, out_ptr, FIRST, LAST, SPLIT, SUM_LO)


@triton.jit(do_not_specialize=["N", "Kb"])
def bwd_dh_kernel(
    dz_ptr,
    w_ptr,
    acc_ptr,
    lo_ptr,
    out_ptr,
    N,
    H,
    Kb,
    stride_dzm,
    stride_wv,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
):
    """acc[N, H] += dz[N, Kb] @ W[0:Kb, :] for one vocabulary block, tile by tile.

    The running sum lives in ``acc_ptr`` (fp32), or for SPLIT in ``acc_ptr`` (the high part, in
    the output's own buffer) plus ``lo_ptr`` (``_sum_join``). LAST writes the result to ``out_ptr``.
    The hidden columns are W's contiguous dimension: they are masked, never clamped, so the
    loads stay vectorised.
    """
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
    _dh_update(part, offs_m, offs_n, N, H, acc_ptr, lo_ptr, out_ptr, FIRST, LAST, SPLIT, SUM_LO)


@triton.jit(do_not_specialize=["N", "Kb"])
def bwd_dh_tma_kernel(
    dz_desc,
    w_desc,
    acc_ptr,
    lo_ptr,
    out_ptr,
    acc_desc,
    lo_desc,
    out_desc,
    N,
    H,
    Kb,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    PRECISION: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM_LO: tl.constexpr,
    FLATTEN: tl.constexpr,
    EPILOGUE_SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    TMA_SUM: tl.constexpr,
):
    """Persistent TMA variant of ``bwd_dh_kernel`` (descriptors zero-fill past Kb, N and H).

    FLATTEN pipelines the tile loop with the K loop; EPILOGUE_SPLITS (1, 2 or 4) updates the sum
    in that many column slices; TMA_SUM reads and writes the sum through the ``*_desc``
    descriptors (blocks of ``[BLOCK_M, BLOCK_N / EPILOGUE_SPLITS]``), not pointers; PREFETCH
    loads the tile's running sum before its K loop; WARP_SPECIALIZE splits loads and MMAs across
    warps. None changes a value: each tile's K order and its one addition to the sum stay the same.
    """
    num_pid_m = tl.cdiv(N, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if PREFETCH and not FIRST:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (offs_m < N)[:, None] & (offs_n < H)[None, :]
            idx = offs_m.to(tl.int64)[:, None] * H + offs_n[None, :]
            prev_hi = tl.load(acc_ptr + idx, mask=mask, other=0)
            if SPLIT:
                prev_lo = tl.load(lo_ptr + idx, mask=mask, other=0)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, tl.cdiv(Kb, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
            a = dz_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            part = tl.dot(a, b, part, input_precision=PRECISION)
        if PREFETCH and not FIRST and not TMA_SUM:
            if SPLIT:  # noqa: SIM108 - constexpr branch
                prev = _sum_join(prev_hi, prev_lo, SUM_LO)
            else:
                prev = prev_hi
            total = prev + part
            _dh_store(total, offs_m, offs_n, N, H, acc_ptr, lo_ptr, out_ptr, LAST, SPLIT, SUM_LO)
        else:
            row0 = pid_m * BLOCK_M
            col = pid_n * BLOCK_N
            w: tl.constexpr = BLOCK_N // EPILOGUE_SPLITS
            if EPILOGUE_SPLITS == 1:
                _dh_slice(part, offs_m, row0, col, N, H, acc_ptr, lo_ptr, out_ptr, acc_desc,
                          lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
            else:
                left, right = _halves(part, BLOCK_M, BLOCK_N)
                if EPILOGUE_SPLITS == 2:
                    _dh_slice(left, offs_m, row0, col, N, H, acc_ptr, lo_ptr, out_ptr, acc_desc,
                              lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
                    _dh_slice(right, offs_m, row0, col + w, N, H, acc_ptr, lo_ptr, out_ptr,
                              acc_desc, lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
                else:  # 4
                    q0, q1 = _halves(left, BLOCK_M, BLOCK_N // 2)
                    q2, q3 = _halves(right, BLOCK_M, BLOCK_N // 2)
                    _dh_slice(q0, offs_m, row0, col, N, H, acc_ptr, lo_ptr, out_ptr, acc_desc,
                              lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
                    _dh_slice(q1, offs_m, row0, col + w, N, H, acc_ptr, lo_ptr, out_ptr,
                              acc_desc, lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
                    _dh_slice(q2, offs_m, row0, col + 2 * w, N, H, acc_ptr, lo_ptr, out_ptr,
                              acc_desc, lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
                    _dh_slice(q3, offs_m, row0, col + 3 * w, N, H, acc_ptr, lo_ptr, out_ptr,
                              acc_desc, lo_desc, out_desc, w, FIRST, LAST, SPLIT, SUM_LO, TMA_SUM)  # fmt: skip
