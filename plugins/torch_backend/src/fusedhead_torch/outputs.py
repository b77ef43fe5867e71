"""The outputs past (log_probs, entropy): top-k, argmax, gather, log-sum-exp, sum of squared p.

One autograd Function walks the same tiles as ``chunked.ChunkedFusedHead`` and calls the same
``forward_tile`` for the row statistics, so its ``log_probs`` and ``entropy`` are the bits of the
plain call; the extras are read off each logit tile before ``forward_tile`` reuses it:

- gather: each id's raw logit, scaled like the label's, so ``gathered`` at ``K = 1`` on the labels
  is bitwise ``log_probs``;
- top-k / argmax: a per-block ``torch.topk`` on ``src`` (the raw logits, or ``tanh(x / c)`` under a
  softcap, whose saturation makes distinct logits equal; the temperature keeps the order), ties
  resolved to the lower id, merged into a running ``[N, k]`` candidate list;
- sum of squared p: ``q = sum exp(2 (z - m))`` per tile, summed like ``s``; ``sum_p2 = q / s^2``.

The forward walks the vocabulary grid (``tiling.GRID_COLS`` columns per tile); the tiles'
statistics and ``q`` are added as fixed-point integers (``rowstats.combine_tiles``). Under a
process group every rank walks its own shard and the same sums are all-reduced
(``parallel.all_reduce_tile_stats``: the one-process bits where the shards lie on the grid); the
gathered logits are summed (one owner each), and the top-k / argmax candidates of all ranks are
all-gathered and merged (``merge_ranks``: by ``src``, equal ones by the lower global id).

Backward recomputes each tile once and forms, in fp32, ``dz = e (A + B d + C e)`` plus the sparse
one-hot terms (label, gathered ids, top-k ids: on a shard, those it owns), with ``d = z - m``,
``e = exp(d)``, per-row ``A, B, C`` folding every upstream gradient. Memory: ``O(N k + N K)``
(``O(world N k)`` for the merge under a process group) plus the tile workspace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fusedhead.protocol import HeadCall, HeadOutput
from fusedhead_torch.chunked import HeadSpec, LabelPlace, first_order
from fusedhead_torch.grads import TileGrads
from fusedhead_torch.options import backward_tiles, forward_tiles, fp32_logits
from fusedhead_torch.parallel import all_gather_rows, all_reduce_sum_, all_reduce_tile_stats
from fusedhead_torch.rowstats import RowStats, TileStats, combine_tiles
from fusedhead_torch.tile_math import (
    FP32,
    Scaling,
    Workspace,
    clamp_scale,
    forward_logits,
    forward_tile,
    inverse_temperature,
    logits_mm,
    offsets,
    recomputed_offsets,
)
from fusedhead_torch.tiling import skips_rows

if TYPE_CHECKING:
    from fusedhead_torch.options import TorchOptions

#: Outputs this module adds to the torch backend.
EXTRA_OUTPUTS = ("lse", "sum_p2", "argmax", "topk", "gather")
#: Outputs it also computes under a process group: all of them (top-k and argmax through a
#: cross-rank merge of each rank's candidates, see ``merge_ranks``).
VOCAB_PARALLEL_OUTPUTS = ("log_probs", "entropy", "lse", "sum_p2", "argmax", "topk", "gather")
#: Largest ``top_k`` the torch backend takes (the candidate lists are ``[N, 2k]`` per merge).
MAX_TOP_K = 4096


@dataclass(frozen=True)
class OutputSpec:
    """What one call asks for beyond ``HeadSpec``."""

    head: HeadSpec
    lse: bool
    sum_p2: bool
    argmax: bool
    top_k: int  #: 0: no top-k output
    gather: bool

    @property
    def candidates(self) -> int:
        """Ids kept per row while walking the blocks (top-k, or 1 for the argmax alone)."""
        return self.top_k or (1 if self.argmax else 0)


def _rank_desc(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vals, ids)`` per row by value, largest first, equal values by the lower id."""
    ids, order = ids.sort(dim=1, stable=True)
    vals, order2 = vals.gather(1, order).sort(dim=1, descending=True, stable=True)
    return vals, ids.gather(1, order2)


def _first_k_columns(x: torch.Tensor, th: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``x``, the columns of its values above ``th [R, 1]`` (the k-th largest), then
    of those equal to it by lowest column, in fixed shapes: exactly ``k`` columns are taken, so a
    top-k of the taken flags finds them all (in no particular order)."""
    greater = x > th
    equal = x == th
    need = k - greater.sum(1, keepdim=True)
    take = greater | (equal & (equal.cumsum(1) <= need))
    return torch.topk(take.to(torch.int32), k, dim=1).indices


def block_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, C)`` largest entries of each row of ``x [R, C]`` (fp32) and their columns.

    ``torch.topk`` leaves open which of several equal values at the boundary it keeps. Asking it
    for one more value shows where that matters: only rows whose k-th and (k+1)-th values are
    equal. Those are redone exactly (all larger values, then the equal ones of lowest column), so
    ties always go to the lower id, without a pass over the whole tile for the others.
    """
    cols_total = x.shape[1]
    k = min(k, cols_total)
    extra = 1 if cols_total > k else 0
    vals, cols = torch.topk(x, k + extra, dim=1, largest=True, sorted=True)
    if extra:
        ambiguous = vals[:, k - 1] == vals[:, k]
        vals, cols = vals[:, :k], cols[:, :k]
        if torch.compiler.is_compiling():  # no data-dependent branch: every row the exact way
            cols = _first_k_columns(x, vals[:, k - 1 :], k)
            vals = x.gather(1, cols)
        elif bool(ambiguous.any()):
            rows = ambiguous.nonzero().squeeze(1)
            xs, th = x[rows], vals[rows, k - 1 :]
            greater = xs > th
            equal = xs == th
            need = k - greater.sum(1, keepdim=True)
            take = greater | (equal & (equal.cumsum(1) <= need))
            chosen = take.nonzero()[:, 1].view(rows.numel(), k)  # row-major: ascending columns
            cols = cols.index_copy(0, rows, chosen)
            vals = vals.index_copy(0, rows, xs.gather(1, chosen))
    return _rank_desc(vals.float(), cols)


def merge_topk(
    run: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of two ranked candidate lists; ``run``'s ids are all lower than ``new``'s."""
    vals = torch.cat([run[0], new[0]], dim=1)
    ids = torch.cat([run[1], new[1]], dim=1)
    # A stable sort keeps run before new among equal values: the lower id first.
    vals, order = vals.sort(dim=1, descending=True, stable=True)
    return vals[:, :k], ids.gather(1, order[:, :k])


def _k_col(k: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``k`` as an fp32 ``[R, 1]`` (or ``[1, 1]``) tensor: a tensor, so that a bf16 tile is
    multiplied in fp32, and the same factor ``forward_tile`` multiplies the label's ``src`` by."""
    if isinstance(k, torch.Tensor):
        return k.to(FP32).unsqueeze(1)
    return torch.full((1, 1), k, dtype=FP32, device=device)


@dataclass
class _Walk:
    """What the forward walk gathers, for all rows."""

    stats: TileStats  #: [T, N] per grid tile (``q`` where sum_p2 is asked)
    z_label: torch.Tensor
    z_gather: (
        torch.Tensor | None
    )  #: [N, K] scaled logits at the gather ids (0 where no block has them)
    cand_vals: torch.Tensor | None  #: [N, k] src (raw logits, or tanh(x / c)) of the best ids
    cand_ids: torch.Tensor | None  #: [N, k] their global ids


def _forward_walk(
    h: torch.Tensor,
    weight: torch.Tensor,
    place: LabelPlace,
    gather_ids: torch.Tensor | None,
    scaling: Scaling,
    spec: OutputSpec,
) -> _Walk:
    n, v = h.shape[0], weight.shape[0]
    hs = spec.head
    tiles = hs.grid_tiles
    dev = h.device
    ws = Workspace(tiles.rows * tiles.cols, dev)
    # Own buffers: src of a softcapped tile (gather, top-k), and d of the sum_p2 pass.
    kk = spec.candidates
    extra = spec.sum_p2 or ((spec.gather or bool(kk)) and hs.softcap is not None)
    mine = Workspace(tiles.rows * tiles.cols, dev) if extra else None
    blocks = list(tiles.col_ranges(v)) if v else []
    m, s, t = (torch.empty(len(blocks), n, dtype=FP32, device=dev) for _ in range(3))
    z_label = torch.zeros(n, dtype=FP32, device=dev)
    q = torch.empty(len(blocks), n, dtype=FP32, device=dev) if spec.sum_p2 else None
    z_gather = None
    if gather_ids is not None:
        z_gather = torch.zeros(gather_ids.shape, dtype=FP32, device=dev)
        gather_local = gather_ids - hs.vocab_start
    width = min(kk, v)
    cand_vals = torch.empty(n, width, dtype=FP32, device=dev) if kk else None
    cand_ids = torch.empty(n, width, dtype=torch.int64, device=dev) if kk else None
    for r0, r1 in tiles.row_ranges(n):
        h_rows = h[r0:r1]
        k = scaling.rows(r0, r1)
        best: tuple[torch.Tensor, torch.Tensor] | None = None
        for b, (v0, v1) in enumerate(blocks):
            x = logits_mm(h_rows, weight[v0:v1].T, hs.fp32_logits)
            cols = v1 - v0
            rows = r1 - r0
            k_col = _k_col(k, dev)
            src = None
            if mine is not None and (z_gather is not None or spec.sum_p2 or kk):
                # src exactly as forward_tile forms it (same op, same tile shape: same bits).
                src = scaling.source(x, out=mine.get(0, rows, cols))
            if z_gather is not None:
                local = gather_local[r0:r1] - v0
                here = (local >= 0) & (local < cols)
                picked = (x if src is None else src).gather(1, local.clamp(0, cols - 1))
                z_gather[r0:r1] = torch.where(here, picked.float() * k_col, z_gather[r0:r1])
            if kk:  # ranked by src: a saturated softcap's equal logits go to the lower id
                vals, ids = block_topk(x if src is None else src, kk)
                ids = ids + (v0 + hs.vocab_start)
                best = (vals, ids) if best is None else merge_topk(best, (vals, ids), kk)
            if q is not None and mine is not None:
                # relative to the tile max exactly as forward_tile forms it (same ops: same bits)
                base = x if src is None else src
                m_tile = (base.amax(dim=1, keepdim=True).float() * k_col).squeeze(1)
                d = offsets(base, k_col, m_tile, out=mine.get(1, rows, cols))
                q[b, r0:r1] = d.exp_().square_().sum(dim=1)
            in_block, col = place.tile(b, r0, r1, cols)
            stats, z_y = forward_tile(x, col, k, scaling, ws, hs.return_entropy)
            del x
            m[b, r0:r1], s[b, r0:r1], t[b, r0:r1] = stats.m, stats.s, stats.t
            z_label[r0:r1] = torch.where(in_block, z_y, z_label[r0:r1])
        if best is not None and cand_vals is not None and cand_ids is not None:
            cand_vals[r0:r1], cand_ids[r0:r1] = best
    return _Walk(TileStats(m, s, t, q), z_label, z_gather, cand_vals, cand_ids)


def merge_ranks(
    vals: torch.Tensor, ids: torch.Tensor, k: int, pad_id: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of every rank's candidates ``(vals, ids) [N, <= k]``, the same on every rank.

    Each rank's list is padded to ``k`` (value -inf, id ``pad_id``, above every real id) and
    gathered in one collective (ids and the values' bits packed in int64); the merge ranks by
    value, equal values by the lower global id, whatever order the shards lie in.
    """
    n, width = vals.shape
    if width < k:
        vals = torch.cat([vals, vals.new_full((n, k - width), -math.inf)], dim=1)
        ids = torch.cat([ids, ids.new_full((n, k - width), pad_id)], dim=1)
    packed = torch.cat([ids, vals.contiguous().view(torch.int32).to(torch.int64)], dim=1)
    pieces = all_gather_rows(packed, group)
    all_ids = torch.cat([p[:, :k] for p in pieces], dim=1)
    all_vals = torch.cat([p[:, k:].to(torch.int32).view(FP32) for p in pieces], dim=1)
    ranked_vals, ranked_ids = _rank_desc(all_vals, all_ids)
    return ranked_vals[:, :k].contiguous(), ranked_ids[:, :k].contiguous()


def _combine(
    walk: _Walk, spec: OutputSpec, v_local: int
) -> tuple[RowStats, torch.Tensor, torch.Tensor | None, _Walk]:
    """Full-vocabulary statistics, label logit and ``q`` from every rank's grid tiles: the same
    fixed-point sums as the plain call (``all_reduce_tile_stats``), so on-grid shards give its
    bits; each gathered id is owned by one rank (0 elsewhere), so the gathered logits are summed
    exactly; top-k and argmax candidates (raw logits, global ids) are merged across ranks
    (``merge_ranks``)."""
    group = spec.head.process_group
    shard = (spec.head.vocab_start, v_local, spec.head.vocab_size)
    stats, z_label, q = all_reduce_tile_stats(walk.stats, walk.z_label, group, shard)
    z_gather = walk.z_gather
    if z_gather is not None:
        z_gather = z_gather.clone()
        all_reduce_sum_(z_gather, group)
    cand_vals, cand_ids = walk.cand_vals, walk.cand_ids
    if cand_vals is not None and cand_ids is not None:
        cand_vals, cand_ids = merge_ranks(
            cand_vals, cand_ids, spec.candidates, spec.head.vocab_size, group
        )
    return stats, z_label, q, _Walk(walk.stats, z_label, z_gather, cand_vals, cand_ids)


def _sparse_add_(
    dz: torch.Tensor, local: torch.Tensor, values: torch.Tensor, counted: torch.Tensor
) -> None:
    """``dz[r, local[r, j]] += values[r, j]`` where ``counted`` and the column is in the tile.

    ``index_put_`` with accumulation sums repeated ids in a fixed order (deterministic).
    """
    rows, cols = dz.shape
    here = counted & (local >= 0) & (local < cols)
    flat = torch.arange(rows, device=dz.device).unsqueeze(1) * cols + local.clamp(0, cols - 1)
    zero = torch.zeros((), dtype=FP32, device=dz.device)
    dz.view(-1).index_put_(
        (flat.reshape(-1),), torch.where(here, values, zero).reshape(-1), accumulate=True
    )


@dataclass(frozen=True)
class _Coefs:
    """Per-row ``A``, ``B``, ``C`` of ``dz = e (A + B d + C e)`` and the sparse terms in z-space."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor | None
    sparse: tuple[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...
    ]  #: (global ids, values, counted)


def _coefficients(
    grads: dict[str, torch.Tensor | None],
    saved: dict[str, torch.Tensor | None],
    labels: torch.Tensor,
    valid: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
) -> _Coefs:
    s = saved["s"]
    assert s is not None
    zero = torch.zeros((), dtype=FP32, device=s.device)
    inv_s = s.reciprocal()
    log_s = torch.log(s)

    def rowwise(g: torch.Tensor | None) -> torch.Tensor | None:
        return None if g is None else torch.where(valid, g.float(), zero)

    a = torch.zeros_like(s)
    b = c = None
    sparse: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    g_lp = rowwise(grads["log_probs"])
    if g_lp is not None:
        a -= g_lp
        owned = valid & (labels >= 0) & (labels < vocab_size)
        sparse.append((labels.unsqueeze(1), g_lp.unsqueeze(1), owned.unsqueeze(1)))
    g_h = rowwise(grads["entropy"])
    if g_h is not None:
        entropy = saved["entropy"]
        assert entropy is not None
        a -= g_h * (entropy - log_s)
        b = -g_h * inv_s
    g_lse = rowwise(grads["lse"])
    if g_lse is not None:
        a += g_lse
    g_p2 = rowwise(grads["sum_p2"])
    if g_p2 is not None:
        sum_p2 = saved["sum_p2"]
        assert sum_p2 is not None
        a -= 2 * g_p2 * sum_p2
        c = 2 * g_p2 * inv_s * inv_s
    for ids_key, g_key in (("gather_ids", "gathered"), ("topk_ids", "topk_log_probs")):
        g = grads[g_key]
        ids = saved[ids_key]
        if g is None or ids is None:
            continue
        counted = valid.unsqueeze(1) & (ids >= 0) & (ids < vocab_size)
        if ids_key == "gather_ids":  # a gathered ignore_index is a constant 0; a top-k id is not
            counted &= ids != ignore_index
        g = torch.where(counted, g.float(), zero)
        a -= g.sum(dim=1)
        sparse.append((ids, g, counted))
    return _Coefs(a * inv_s, b, c, tuple(sparse))


def _backward_walk(
    h: torch.Tensor,
    weight: torch.Tensor,
    scaling: Scaling,
    spec: HeadSpec,
    row_max: torch.Tensor,
    coefs: _Coefs,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dh`` (fp32, then the input dtype) and ``dW``, one recomputed tile at a time."""
    n, v = h.shape[0], weight.shape[0]
    tiles = spec.tiles
    row_chunks = list(tiles.row_ranges(n))
    blocks = list(tiles.col_ranges(v))
    ws = Workspace(tiles.rows * tiles.cols, h.device)
    low = h.dtype != FP32
    grads = TileGrads(h, weight, len(row_chunks), len(blocks), need_h, need_w)
    for v0, v1 in blocks:
        w_block = weight[v0:v1]
        cols = v1 - v0
        for r0, r1 in row_chunks:
            rows = r1 - r0
            h_rows = h[r0:r1]
            x = forward_logits(h, weight, (r0, r1), (v0, v1), spec.grid_tiles, spec.fp32_logits)
            # Buffers as the plain path has them: an fp32 tile is worked in place (src, or d
            # without softcap); e and a separate d take workspace slots; dz goes back into a
            # tile of the input dtype; a softcap's derivative takes one more.
            x32 = x.dtype == FP32
            capped = scaling.softcap is not None
            # the softcap's derivative from x itself, before src may overwrite it
            sech2 = scaling.sech2(x, out=ws.get(3, rows, cols)) if capped else None
            src = scaling.source(x, out=x if x32 else ws.get(0, rows, cols))
            d_out = x if x32 and not capped else ws.get(2, rows, cols)
            k_col = _k_col(scaling.rows(r0, r1), h.device)
            d = recomputed_offsets(src, k_col, row_max[r0:r1], d_out)
            e = torch.exp(d, out=ws.get(1, rows, cols))
            a = coefs.a[r0:r1].unsqueeze(1)
            if coefs.b is not None:
                u = torch.addcmul(a, d, coefs.b[r0:r1].unsqueeze(1), out=d)
            else:
                u = d.copy_(a.expand_as(d))
            if coefs.c is not None:
                u.addcmul_(e, coefs.c[r0:r1].unsqueeze(1))
            dz = e.mul_(u)
            for ids, values, counted in coefs.sparse:
                local = ids[r0:r1] - (spec.vocab_start + v0)
                _sparse_add_(dz, local, values[r0:r1], counted[r0:r1])
            dz.mul_(_k_col(scaling.inv_t_rows(r0, r1), h.device))
            if sech2 is not None:
                dz.mul_(sech2)  # d tanh(y) = sech(y)^2
            if not low:
                dz_in = dz
            elif x.dtype == h.dtype:  # x is free now: the cast dz takes its place
                dz_in = x.copy_(dz)
            else:
                dz_in = dz.to(h.dtype)
            del x
            grads.add(dz_in, w_block, h_rows, (r0, r1), (v0, v1))
            del dz_in
        grads.end_block((v0, v1))
    del ws
    return grads.result(spec.process_group, spec.reduce_hidden_grad)


def _unasked(device: torch.device, dtype: torch.dtype = FP32) -> torch.Tensor:
    """The placeholder of an output not asked for: a new one each time, since torch.compile's
    tracing of an autograd Function mis-wires its backward when one tensor is returned twice."""
    return torch.zeros(0, dtype=dtype, device=device)


class ChunkedHeadOutputs(torch.autograd.Function):
    """All requested outputs of one head in one pass; see the module docstring.

    Returns ``(log_probs, entropy, lse, sum_p2, topk_log_probs, gathered, argmax, topk_ids)``;
    outputs not asked for are empty placeholders the caller drops.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        gather_ids: torch.Tensor | None,
        inv_t: float | torch.Tensor,
        spec: OutputSpec,
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        hs = spec.head
        h = hidden.contiguous()
        n, dev = h.shape[0], h.device
        inv_t = clamp_scale(inv_t)  # as ChunkedFusedHead does: the same z, the same bits
        scaling = Scaling(inv_t, hs.softcap)
        place = LabelPlace.locate(labels, weight.shape[0], hs, hs.grid_tiles)
        with torch.autocast(device_type=dev.type, enabled=False):
            walk = _forward_walk(h, weight, place, gather_ids, scaling, spec)
        if hs.process_group is not None and n > 0:
            stats, z_label, q, walk = _combine(walk, spec, weight.shape[0])
        else:
            (stats, q), z_label = combine_tiles(walk.stats), walk.z_label
        valid = place.valid
        zero = torch.zeros((), dtype=FP32, device=dev)
        nan = torch.full((), math.nan, dtype=FP32, device=dev)
        log_s = torch.log(stats.s)
        log_probs = torch.where(valid, (z_label - stats.m).sub_(log_s), zero)
        out_of_range = valid & ((labels < 0) | (labels >= hs.vocab_size))
        log_probs = torch.where(out_of_range, nan, log_probs)
        entropy = torch.where(valid, stats.entropy(), zero) if hs.return_entropy else None
        lse = torch.where(valid, stats.log_sum_exp(), zero) if spec.lse else _unasked(dev)
        sum_p2 = _unasked(dev)
        if q is not None:
            sum_p2 = torch.where(valid, q / (stats.s * stats.s), zero)
        gathered = _unasked(dev)
        if walk.z_gather is not None and gather_ids is not None:
            g = (walk.z_gather - stats.m.unsqueeze(1)).sub_(log_s.unsqueeze(1))
            counted = valid.unsqueeze(1) & (gather_ids != hs.ignore_index)
            gathered = torch.where(counted, g, zero)
            bad = counted & ((gather_ids < 0) | (gather_ids >= hs.vocab_size))
            gathered = torch.where(bad, nan, gathered)
        topk_lp = _unasked(dev)
        topk_ids = _unasked(dev, torch.int64)
        argmax = _unasked(dev, torch.int64)
        if walk.cand_vals is not None and walk.cand_ids is not None:
            # A row whose normaliser is NaN (a NaN or infinite logit: a NaN hidden state or
            # temperature, a NaN or inf weight row) has no most likely id: -1, as an ignored
            # row's, never an id ranked by NaN's order. Read from s, which a process group's SUM
            # keeps NaN on every rank (its MAX of m may drop a NaN).
            ranked = valid & ~torch.isnan(stats.m) & ~torch.isnan(log_s)
            ids = torch.where(ranked.unsqueeze(1), walk.cand_ids, -1)
            if spec.argmax:
                argmax = ids[:, 0].contiguous()
            if spec.top_k:
                z = walk.cand_vals * _k_col(scaling.rows(0, n), dev)  # src (x or tanh) * k
                lp = (z - stats.m.unsqueeze(1)).sub_(log_s.unsqueeze(1))
                topk_lp = torch.where(valid.unsqueeze(1), lp, zero)
                topk_ids = ids
        ctx.mark_non_differentiable(argmax, topk_ids)
        ctx.spec = spec
        ctx.inv_t = None if isinstance(inv_t, torch.Tensor) else inv_t
        ctx.save_for_backward(
            hidden,
            weight,
            labels,
            gather_ids,
            topk_ids if spec.top_k else None,
            stats.m,
            stats.s,
            entropy,
            sum_p2 if spec.sum_p2 else None,
            inv_t if isinstance(inv_t, torch.Tensor) else None,
        )
        ent_out = entropy if entropy is not None else _unasked(dev)
        return log_probs, ent_out, lse, sum_p2, topk_lp, gathered, argmax, topk_ids

    @staticmethod
    @first_order
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        (hidden, weight, labels, gather_ids, topk_ids, m, s, entropy, sum_p2, inv_t_tensor) = (
            ctx.saved_tensors
        )
        spec: OutputSpec = ctx.spec
        hs = spec.head
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp, g_ent, g_lse, g_p2, g_topk, g_gath = grads[:6]
        named = {
            "log_probs": g_lp,
            "entropy": g_ent if hs.return_entropy else None,
            "lse": g_lse if spec.lse else None,
            "sum_p2": g_p2 if spec.sum_p2 else None,
            "topk_log_probs": g_topk if spec.top_k else None,
            "gathered": g_gath if spec.gather else None,
        }
        nothing = (None,) * 6
        if all(g is None for g in named.values()) or not (need_h or need_w):
            return nothing
        inv_t = inv_t_tensor if inv_t_tensor is not None else ctx.inv_t
        scaling = Scaling(inv_t, hs.softcap)
        valid = labels != hs.ignore_index
        h = hidden.contiguous()
        if h.device.type != "cpu" or torch.compiler.is_compiling() or not bool(valid.all()):
            # Ignored rows read as zeros (row max 0, sum 1): a NaN in one reaches neither dh nor dW.
            h = torch.where(valid.unsqueeze(1), h, torch.zeros((), dtype=h.dtype, device=h.device))
            m = torch.where(valid, m, torch.zeros_like(m))
            s = torch.where(valid, s, torch.ones_like(s))
        saved = {
            "s": s,
            "entropy": entropy,
            "sum_p2": sum_p2,
            "gather_ids": gather_ids,
            "topk_ids": topk_ids,
        }
        coefs = _coefficients(named, saved, labels, valid, hs.vocab_size, hs.ignore_index)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            dh, dw = _backward_walk(h, weight, scaling, hs, m, coefs, need_h, need_w)
        return dh, dw, None, None, None, None


def _scatter_rows(t: torch.Tensor, keep: torch.Tensor | None, n: int, fill: int) -> torch.Tensor:
    """``t`` of the kept rows back in all ``n`` rows (``fill`` elsewhere; differentiable). No
    kept row (every label ignore_index) is ``n`` rows of ``fill`` too, not the empty ``t``."""
    if keep is None:
        return t
    out = t.new_full((n, *t.shape[1:]), fill)
    return out.index_copy(0, keep, t)


def forward_outputs(options: TorchOptions, call: HeadCall) -> HeadOutput:
    """Every requested output of ``call`` on the torch backend, in one pass over the tiles."""
    if call.process_group is not None and not call.outputs <= frozenset(VOCAB_PARALLEL_OUTPUTS):
        raise ValueError(  # the core refuses these first (vocab_parallel_outputs)
            f"process_group: the torch backend computes {list(VOCAB_PARALLEL_OUTPUTS)} across "
            f"vocabulary shards, not {sorted(call.outputs.difference(VOCAB_PARALLEL_OUTPUTS))}"
        )
    hidden, weight, labels = call.hidden, call.weight, call.labels
    gather_ids = call.gather_ids
    n = hidden.shape[0]
    scored = labels != call.ignore_index
    inv_t = inverse_temperature(call.temperature, scored)
    keep = scored.nonzero().squeeze(1) if skips_rows(options.skip_ignored_rows, hidden) else None
    if keep is not None and keep.numel() < n:
        hidden = hidden.index_select(0, keep)
        labels = labels.index_select(0, keep)
        if gather_ids is not None:
            gather_ids = gather_ids.index_select(0, keep)
        if isinstance(inv_t, torch.Tensor):
            inv_t = inv_t.index_select(0, keep)
    else:
        keep = None
    outputs = call.outputs
    head = HeadSpec(
        ignore_index=int(call.ignore_index),
        return_entropy="entropy" in outputs,
        softcap=None if call.softcap is None else float(call.softcap),
        tiles=backward_tiles(
            options, hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device, call.softcap
        ),
        vocab_start=call.vocab_start,
        vocab_size=call.vocab_size,
        fp32_logits=fp32_logits(options, hidden.device),
        process_group=call.process_group,
        reduce_hidden_grad=call.reduce_hidden_grad,
        forward_tiles=forward_tiles(
            options, hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device, call.softcap
        ),
    )
    spec = OutputSpec(
        head=head,
        lse="lse" in outputs,
        sum_p2="sum_p2" in outputs,
        argmax="argmax" in outputs,
        top_k=call.top_k if "topk" in outputs else 0,
        gather=gather_ids is not None,
    )
    res = ChunkedHeadOutputs.apply(hidden, weight, labels, gather_ids, inv_t, spec)  # type: ignore[no-untyped-call]
    lp, ent, lse, p2, topk_lp, gathered, argmax, topk_ids = res

    def back(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
        return _scatter_rows(t, keep, n, fill)

    return HeadOutput(
        log_probs=back(lp),
        entropy=back(ent) if head.return_entropy else None,
        lse=back(lse) if spec.lse else None,
        sum_p2=back(p2) if spec.sum_p2 else None,
        argmax=back(argmax, -1) if spec.argmax else None,
        topk_ids=back(topk_ids, -1) if spec.top_k else None,
        topk_log_probs=back(topk_lp) if spec.top_k else None,
        gathered=back(gathered) if spec.gather else None,
    )
