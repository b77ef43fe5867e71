"""Forward with top-k: the forward's tile statistics and each row's most likely ids, one pass.

A program owns a row block and a fixed chunk of consecutive vocabulary tiles (the chunks depend
on V and the tile width only, never on N: batch invariance). For each tile it writes the plain
forward's statistics (``forward._stats_epilogue``: the same logits; the sums are reduced in
this kernel's 64-row layout, equal to fp32 rounding on a GPU) and folds the tile into the
row's running set of ``KP`` best keys (in registers; written to ``cand[chunk]`` at the end):

- a key is an int64 ordering (value, then lower id): the fp32 logit's bits made monotone in the
  high word, ``2**31 - 1 - column`` in the low word, so one integer order resolves ties;
- a tile only visits its entries above the set's smallest value (about ``KP / j`` per row at the
  chunk's j-th tile, all of them at the first), in rounds that take each row's best remaining
  entry and put it in place of the set's smallest key; the rounds stop when no row holds an
  entry that could still enter. Each round is a few compare-and-select passes over the tile.

The set is a set (its order is never read), so the result does not depend on the order of the
insertions; the chunks' sets ``cand[C, N, KP]`` are merged by key afterwards (launcher).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import grouped_tile, logits_tile, logits_tile_tma
from .forward import _stats_epilogue
from .sparse import tile_bounds

#: Below every key (no candidate).
MIN_KEY = tl.constexpr(-(2**63))
#: An empty slot of the set (plus the slot index, so that the slots are distinct): the value
#: word of -inf and a low word below any column's, so above ``MIN_KEY``, below every entry.
EMPTY_KEY = tl.constexpr(-2139095041 * 2**32)


@triton.jit
def topk_keys(z, col):
    """int64 keys of fp32 values ``z`` at int32 columns ``col``: larger value first, then lower
    column (-0.0 counts as +0.0)."""
    b = z.to(tl.int32, bitcast=True)
    b = tl.where(z == 0.0, 0, b)
    mono = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def key_value(key):
    """The fp32 value a key was made from."""
    mono = (key >> 32).to(tl.int32)
    return (mono ^ ((mono >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _insert(run, cand):
    """Put ``cand [R]`` in place of each row's smallest key of ``run [R, KP]`` where it is larger
    (keys in a row are distinct; ``MIN_KEY`` never enters)."""
    low = tl.min(run, axis=1)
    take = cand > low
    return tl.where((run == low[:, None]) & take[:, None], cand[:, None], run)


@triton.jit
def fold_tile(run, thr, z, col0, BLOCK_N: tl.constexpr):
    """Fold the tile ``z [BLOCK_M, BLOCK_N]`` (first column ``col0``, past every column of the
    set) into the running set ``run [BLOCK_M, KP]``, visiting only entries above the set's
    smallest value ``thr``: one entry per row and round, the best remaining. Returns the new
    set and ``thr``."""
    cols = tl.arange(0, BLOCK_N)[None, :]
    rem = tl.where(z > thr[:, None], z, float("-inf"))
    best = tl.max(rem, axis=1)
    # >=: an entry equal to the smallest value may still enter by its lower column.
    live = (best >= thr) & (best > float("-inf"))
    go = tl.max(live.to(tl.int32), axis=0)
    while go > 0:
        at = tl.min(tl.where(rem == best[:, None], cols, BLOCK_N), axis=1)
        run = _insert(run, tl.where(live, topk_keys(best, at + col0), MIN_KEY))
        thr = key_value(tl.min(run, axis=1))
        rem = tl.where(cols == at[:, None], float("-inf"), rem)
        best = tl.max(rem, axis=1)
        live = (best >= thr) & (best > float("-inf"))
        go = tl.max(live.to(tl.int32), axis=0)
    return run, thr


@triton.jit
def _tile_z(
    h_src, w_src, t, off_m, offs_m, rows, labels_ptr, temp_ptr, ws_ptr, zy_ptr, q_ptr,
    arg_ptr, starts_ptr, sids_ptr, zg_ptr, N, V, H, K_g, stride_hn, stride_hk, stride_wv, stride_wk,
    label_offset, inv_temp, softcap, inv_softcap, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_Q: tl.constexpr,
    HAS_ARG: tl.constexpr, HAS_GATHER: tl.constexpr,
):  # fmt: skip
    """Tile ``t`` of the row block: its logits GEMM, the forward's statistics (written), and
    the scaled logits ``z`` returned."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    g_lo, g_hi = tile_bounds(starts_ptr, t, rows, N, HAS_GATHER)
    if USE_TMA:
        acc = logits_tile_tma(
            h_src, w_src, off_m, t * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION
        )
    else:
        acc = logits_tile(
            h_src, w_src, rows, tl.minimum(offs_n, V - 1), H, stride_hn, stride_hk, stride_wv,
            stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
        )  # fmt: skip
    return _stats_epilogue(
        acc, offs_m, offs_n, t, N, V, labels_ptr, temp_ptr, ws_ptr, zy_ptr, q_ptr, arg_ptr,
        sids_ptr, zg_ptr, g_lo, g_hi, K_g, label_offset, inv_temp, softcap, inv_softcap,
        BLOCK_N, PER_TOKEN_T, HAS_SOFTCAP, HAS_Q, HAS_ARG, HAS_GATHER,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N", "V", "K_g", "L"])
def fwd_topk_kernel(
    h_src,
    w_src,
    labels_ptr,
    temp_ptr,
    ws_ptr,
    zy_ptr,
    q_ptr,
    arg_ptr,
    starts_ptr,
    sids_ptr,
    zg_ptr,
    cand_ptr,
    N,
    V,
    H,
    K_g,
    L,
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
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    PER_TOKEN_T: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_ARG: tl.constexpr,
    HAS_GATHER: tl.constexpr,
    KP: tl.constexpr,
):
    """One program per (row block, chunk of ``L`` tiles): the tiles' statistics as the forward
    writes them, and the chunk's ``KP`` best keys per row into ``cand[chunk, N, KP]``.

    ``h_src``/``w_src`` are TMA descriptors with ``USE_TMA``, else pointers (with the strides).
    """
    num_pid_m = tl.cdiv(N, BLOCK_M)
    T = tl.cdiv(V, BLOCK_N)
    pid_m, chunk = grouped_tile(tl.program_id(0), num_pid_m, tl.cdiv(T, L), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, N - 1)
    row_ok = offs_m < N
    slot = tl.arange(0, KP)
    run_ptrs = cand_ptr + (chunk.to(tl.int64) * N + offs_m)[:, None] * KP + slot[None, :]
    # The set starts with KP distinct keys below every entry's, whose value reads -inf.
    run = tl.zeros((BLOCK_M, KP), tl.int64) + EMPTY_KEY + slot[None, :]
    thr = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    t0 = chunk * L
    for j in range(0, tl.minimum(L, T - t0)):
        t = t0 + j
        z = _tile_z(
            h_src, w_src, t, pid_m * BLOCK_M, offs_m, rows, labels_ptr, temp_ptr, ws_ptr,
            zy_ptr, q_ptr, arg_ptr, starts_ptr, sids_ptr, zg_ptr, N, V, H, K_g, stride_hn,
            stride_hk, stride_wv, stride_wk, label_offset, inv_temp, softcap, inv_softcap,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, PRECISION, PER_TOKEN_T, HAS_SOFTCAP,
            HAS_Q, HAS_ARG, HAS_GATHER,
        )  # fmt: skip
        run, thr = fold_tile(run, thr, z, t * BLOCK_N, BLOCK_N)
    tl.store(run_ptrs, run, mask=row_ok[:, None])
