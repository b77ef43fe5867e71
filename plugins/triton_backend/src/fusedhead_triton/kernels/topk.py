"""Top-k kernels (launcher: ``fusedhead_triton.topk``): the candidate tiles' scaled logits again
(``tiles_at_kernel``: the forward's GEMM and ``forward.scaled_tile``, so the forward's bits), and
each row's best keys among them (``select_kernel``):

- a key is an int64 ordering (value, then lower id): the fp32 logit's bits made monotone in the
  high word, ``2**31 - 1 - column`` in the low word, so one integer order resolves ties;
- a tile only visits its entries above the set's smallest value, in rounds that take each row's
  best remaining entry and put it in place of the set's smallest key, until no row holds an
  entry that could still enter. The set's order is never read: the result does not depend on
  the order of the insertions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import logits_tile
from .forward import scaled_tile

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


@triton.jit(do_not_specialize=["N", "V", "KT", "G"])
def tiles_at_kernel(
    h_ptr, w_src, temp_ptr, prog_ptr, starts_ptr, pairs_ptr, cand_ptr, N, V, H, KT, G, stride_hn,
    stride_hk, stride_wv, stride_wk, inv_temp, softcap, inv_softcap, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, PER_TOKEN_T: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per chunk of ``BLOCK_M`` (row, slot) pairs of one tile: that tile's scaled
    logits for the pairs' rows, as the forward computes them (``forward.scaled_tile``), into
    ``cand[row, slot, :]``.

    ``prog[0, pid]`` is the program's tile (``T`` or more: nothing to do), ``prog[1, pid]`` its
    first position in ``pairs`` (the pairs ``row * KT + slot`` sorted by tile); the tile's
    pairs end at ``starts[tile + 1]``. The rows come by pointers (gathered), the weight by TMA
    with ``USE_TMA`` (``w_src`` a descriptor, as the forward loads it), in the forward's K order.
    """
    pid = tl.program_id(0)
    t = tl.load(prog_ptr + pid)
    if t < tl.cdiv(V, BLOCK_N):
        lo = tl.load(prog_ptr + G + pid)
        idx = lo + tl.arange(0, BLOCK_M)
        ok = idx < tl.load(starts_ptr + t + 1)
        pair = tl.load(pairs_ptr + idx, mask=ok, other=0)
        rows = pair // KT
        if USE_TMA:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = h_ptr + rows[:, None] * stride_hn + offs_k[None, :] * stride_hk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(H, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=(offs_k < H - k * BLOCK_K)[None, :], other=0.0)
                b = w_src.load([t * BLOCK_N, k * BLOCK_K])  # columns past V read zero
                acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K * stride_hk
        else:
            cols = tl.minimum(t * BLOCK_N + tl.arange(0, BLOCK_N), V - 1)
            acc = logits_tile(
                h_ptr, w_src, rows, cols, H, stride_hn, stride_hk, stride_wv, stride_wk, BLOCK_M,
                BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
            )  # fmt: skip
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        z = scaled_tile(
            acc, rows, offs_n, V, temp_ptr, inv_temp, softcap, inv_softcap, PER_TOKEN_T, HAS_SOFTCAP
        )
        out = cand_ptr + pair[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(out, z, mask=ok[:, None])


@triton.jit(do_not_specialize=["N", "KT"])
def select_kernel(
    cand_ptr, floor_ptr, keys_ptr, N, KT, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    KP: tl.constexpr,
):  # fmt: skip
    """One program per ``BLOCK_R`` rows: fold the rows' ``KT`` slots ``cand[row, slot, :]``
    (the candidate tiles' logits in ascending id order, or the tile maxima) into each row's
    ``KP`` best keys, written to ``keys[N, KP]`` (a set: unordered). Column
    ``slot * BLOCK_N + c`` stands for the slot's column ``c``. Entries below the row's
    ``floor`` (no top-k entry is) are skipped: most of the rounds a tile would take."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r = tl.minimum(rows, N - 1)
    base = r.to(tl.int64) * KT
    lim = tl.load(floor_ptr + r)[:, None]
    cols = tl.arange(0, BLOCK_N)
    slot = tl.arange(0, KP)
    # The set starts with KP distinct keys below every entry's, whose value reads -inf.
    run = tl.zeros((BLOCK_R, KP), tl.int64) + EMPTY_KEY + slot[None, :]
    thr = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for j in range(0, KT):
        z = tl.load(cand_ptr + (base + j)[:, None] * BLOCK_N + cols[None, :])
        z = tl.where(z >= lim, z, float("-inf"))
        run, thr = fold_tile(run, thr, z, j * BLOCK_N, BLOCK_N)
    out = keys_ptr + rows.to(tl.int64)[:, None] * KP + slot[None, :]
    tl.store(out, run, mask=(rows < N)[:, None])
