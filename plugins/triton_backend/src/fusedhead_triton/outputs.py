"""The outputs past (log_probs, entropy) on the triton backend: lse, sum_p2, argmax, gather, top-k.

They come from the log-prob forward's own tiles, each behind a constexpr flag (a one-shard call
without them runs the plain ops, ``ops.head``):

- lse: the combine's log-sum-exp (ignored rows 0); sum_p2: ``q = sum exp(2 (z - m))`` per tile,
  rebased like ``s`` in the combine, over ``s^2``; argmax: each tile's lowest column among its
  maxima, the first tile holding the row max (so the lowest id among the maxima);
- gather: the logits at caller ids, taken from the tile with the label logit's own extraction
  (``kernels.sparse``: each tile visits only the ids in its range), minus the same lse: at K = 1
  on the labels, the bits of ``log_probs``;
- top-k: ``topk.topk_partials`` (the same tile statistics, and each row's k best keys), its
  values' gradient the gather's with the top-k ids.

The backward is the log-prob backward (``backward_from``) with further per-row terms and the
sparse terms of the gathered ids in the dz kernel, in fp32 before dz is rounded. One shard runs
as ``torch.library`` custom ops (``torch.compile`` fullgraph); every vocab-parallel call, the plain
(log_probs, entropy) one included, as one autograd Function, ``ShardedOutputs``, whose collectives
run between the launches (the row max MAX-reduced, the ranks' fixed-point tile sums SUM-reduced as
integers and finished as one process finishes its own, so shards on the tile grid give the
one-process bits; each gathered id owned by one rank, the argmax the lowest id among the ranks'
maxima; the hidden gradient summed in fp32 where asked).
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as types.

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fusedhead.protocol import HeadCall, HeadOutput
from fusedhead.shards import check_shards, shard_slots_tensor, shards_need_check

from .backward import backward_from
from .configs import Settings, TileConfig
from .custom_ops import DOUBLE_BACKWARD, grads_or_empty, register_pair
from .launch import (
    DzExtras,
    HeadScalars,
    PartialExtras,
    Partials,
    RowGrads,
    SortedIds,
    combine_extras,
    dz_block,
    finish_rows,
    forward_partials,
    sort_ids,
    tile_sums,
)
from .topk import finish, ranked_rows, topk_partials


class Values(NamedTuple):
    """The forward's results; a dummy (empty) tensor for each output not asked."""

    log_probs: torch.Tensor
    norm: torch.Tensor  #: [2, N] every row's max and log s (the backward's), ignored rows included
    entropy: torch.Tensor
    lse_out: torch.Tensor  #: 0 on ignored rows
    sum_p2: torch.Tensor
    argmax: torch.Tensor
    gathered: torch.Tensor
    topk_ids: torch.Tensor
    topk_log_probs: torch.Tensor


def _empty(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _counted(ids: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Caller ids that give a log-prob: on scored rows and not ``ignore_index``."""
    return (labels != ignore_index).unsqueeze(1) & (ids != ignore_index)


def gathered_grad(
    g: torch.Tensor | None, gather_ids: torch.Tensor | None, ignore_index: int
) -> torch.Tensor | None:
    """The upstream gradient of the gathered log-probs in fp32, 0 at ids equal to
    ``ignore_index`` (their log-prob is a constant 0)."""
    if g is None or gather_ids is None:
        return None
    return torch.where(gather_ids != ignore_index, g.to(torch.float32), 0.0).contiguous()


def _unsorted(zg: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Values in sorted-id order back in the caller's order."""
    return torch.empty_like(zg).scatter_(1, perm, zg)


def _gathered(
    z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, ids: torch.Tensor,
    labels: torch.Tensor, ignore: int,
) -> torch.Tensor:  # fmt: skip
    """``(z - m) - log s`` where counted, else 0: the subtraction the combine makes for the label."""
    lp = (z - m.unsqueeze(1)) - log_s.unsqueeze(1)
    return torch.where(_counted(ids, labels, ignore), lp, 0.0)


def forward_values(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    gather_ids: torch.Tensor | None, sc: HeadScalars, cfg: TileConfig, *, entropy: bool,
    sum_p2: bool, argmax: bool, top_k: int = 0, group: Any = None, vocab_size: int = 0,
) -> Values:  # fmt: skip
    """Every asked output over the whole (possibly sharded) vocabulary, in exact tile sums
    (``vocab_size``: under ``group``, the one the shards must cover)."""
    ig, lo, v_local = sc.ignore_index, sc.label_offset, weight.shape[0]
    ids = None if gather_ids is None else sort_ids(gather_ids, labels, lo, v_local, ig)
    extras = PartialExtras(sum_p2=sum_p2, argmax=argmax, gather=ids)
    top = None
    if top_k:
        if group is not None:
            raise ValueError(  # the core refuses it first (vocab_parallel_outputs)
                "top_k: the triton backend computes top-k on one shard only, not under "
                "process_group"
            )
        p, top = topk_partials(hidden, weight, labels, temp, sc, cfg, top_k, extras)
    else:
        p = forward_partials(hidden, weight, labels, temp, sc, cfg, extras)
    zg = None if ids is None or p.zg is None else _unsorted(p.zg, ids.perm)
    arg_out: torch.Tensor | None = None
    if group is None:
        out = combine_extras(p, labels, ig, entropy=entropy, label_offset=lo, arg_width=cfg.block_n)
        lp, lse, ent = out.log_probs, out.lse, out.entropy
        p2, arg_out, m, log_s = out.sum_p2, out.argmax, out.row_max, out.log_s
    else:
        lp, lse, ent, p2, arg_out, zg, m, log_s = _sharded_combine(
            p, zg, gather_ids, labels, sc, v_local, cfg, entropy, sum_p2, argmax, group, vocab_size
        )  # fmt: skip
    valid = labels != ig
    if arg_out is not None:
        arg_out = torch.where(ranked_rows(m, log_s), arg_out, -1)
    tk = None if top is None else finish(top, m, log_s, labels, ig)
    return Values(
        lp, torch.stack((m, log_s)), ent if entropy else _empty(lp), torch.where(valid, lse, 0.0),
        p2 if sum_p2 else _empty(lp),
        arg_out if argmax and arg_out is not None else _empty(lp, torch.int64),
        _empty(lp) if zg is None or gather_ids is None else _gathered(zg, m, log_s, gather_ids, labels, ig),
        _empty(lp, torch.int64) if tk is None else tk.ids.contiguous(),
        _empty(lp) if tk is None else tk.logits.contiguous(),
    )  # fmt: skip


def _sharded_combine(
    p: Partials, zg: torch.Tensor | None, gather_ids: torch.Tensor | None, labels: torch.Tensor,
    sc: HeadScalars, v_local: int, cfg: TileConfig, entropy: bool, sum_p2: bool, argmax: bool,
    group: Any, vocab_size: int,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
    torch.Tensor | None, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """The full vocabulary's outputs from every rank's tiles, the one-process bits where the
    shards start on the tile grid: the row max MAX-reduced, each rank's fixed-point tile sums
    relative to it (``launch.tile_sums``) SUM-reduced as int64 (exact in any order) and finished
    by the one-process kernel (``launch.finish_rows``). The label logit's bits and its owner count
    ride in the same all-reduce (NaN where no rank owns the label), as does each rank's shard
    (``SHARD_FLOATS`` slots), which every rank checks against ``vocab_size``
    (``fusedhead.shards.check_shards``). A gathered logit comes from its one owner; the
    argmax is the lowest id among the ranks holding the row max (a MIN all-reduce)."""
    ig, lo = sc.ignore_index, sc.label_offset
    n = labels.shape[0]
    if p.ws.shape[1]:
        local_m = p.ws[0].amax(dim=0)
    else:  # an empty shard
        local_m = torch.full((n,), float("-inf"), dtype=torch.float32, device=labels.device)
    m = local_m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    _, sums, arg = tile_sums(p, m, lo, cfg.block_n)
    owned = (labels >= lo) & (labels < lo + v_local)
    bits = torch.where(owned, p.zy, 0.0).view(torch.int32).to(torch.int64)
    shard = (lo, v_local, vocab_size)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = shard_slots_tensor(*shard, m.device, world, rank).reshape(-1).to(torch.int64)
    packed = torch.cat([sums.reshape(-1), bits, owned.to(torch.int64), slots])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    if not torch.compiler.is_compiling() and shards_need_check(group, *shard, m.device):
        check_shards(packed[6 * n :], rank, group, *shard)
    label_logit = torch.where(
        packed[5 * n : 6 * n] == 1, packed[4 * n : 5 * n].to(torch.int32).view(torch.float32),
        float("nan"),
    )  # fmt: skip
    lp, lse, ent, p2, log_s = finish_rows(
        m, packed[: 4 * n].view(4, n), label_logit, labels, ig, entropy=entropy, sum_p2=sum_p2
    )
    arg_out = None
    if argmax and arg is not None:
        none = torch.iinfo(torch.int64).max
        pick = torch.where((local_m == m) & (arg >= 0), arg, none)
        dist.all_reduce(pick, op=dist.ReduceOp.MIN, group=group)
        arg_out = torch.where((pick == none) | (labels == ig), -1, pick)
    if zg is not None and gather_ids is not None:
        mine = (gather_ids >= lo) & (gather_ids < lo + v_local)
        both = torch.stack([torch.where(mine, zg, 0.0), mine.to(torch.float32)])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)  # one owner: exact
        zg = torch.where(both[1] == 1, both[0], float("nan"))
    return lp, lse, ent, p2, arg_out, zg, m, log_s


class Grads(NamedTuple):
    """Upstream gradients of the differentiable outputs (None: not reached by the loss)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    lse: torch.Tensor | None
    sum_p2: torch.Tensor | None
    sparse: torch.Tensor | None  #: [N, K] of the ids in ``sparse_ids``


def _fp32(g: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else g.to(torch.float32).contiguous()


def backward_values(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sparse_ids: torch.Tensor | None, norm: torch.Tensor, lp: torch.Tensor,
    ent: torch.Tensor | None, sum_p2: torch.Tensor | None, grads: Grads, sc: HeadScalars, vocab_size: int, st: Settings,
    *, need_dh: bool, need_dw: bool, dh_fp32: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(dh, dW) of the asked outputs: ``dz = p (ax + c p) + onehots - ...`` per vocabulary block,
    ``ax = g_lse - 2 g_p2 sum_p2 - sum_j g_j``, ``c = 2 g_p2``, the sparse ``g_j`` at the ids."""
    ig = sc.ignore_index
    valid = labels != ig
    ax: torch.Tensor | None = None
    if grads.lse is not None:
        ax = grads.lse.clone()
    c = None
    if grads.sum_p2 is not None and sum_p2 is not None:
        term = -2.0 * grads.sum_p2 * sum_p2
        ax = term if ax is None else ax + term
        c = 2.0 * grads.sum_p2
    ids: SortedIds | None = None
    gs = None
    if grads.sparse is not None and sparse_ids is not None:
        # a gathered id equal to ignore_index came with a zero gradient (gathered_grad); a top-k
        # id may be that id, and its log-prob is differentiable as any other's
        in_range = (sparse_ids >= 0) & (sparse_ids < vocab_size) & valid.unsqueeze(1)
        g = torch.where(in_range, grads.sparse, 0.0)
        total = -g.sum(dim=1)
        ax = total if ax is None else ax + total
        ids = sort_ids(sparse_ids, labels, sc.label_offset, weight.shape[0], ig, False)
        gs = g.gather(1, ids.perm).contiguous()
    if ax is not None:
        ax = torch.where(valid, ax, 0.0).contiguous()
    rows = RowGrads(labels, temp, norm, lp, ent, grads.log_probs, grads.entropy)
    extra = DzExtras(ax, None if c is None else c.contiguous(), ids, gs)

    def fill_dz(v0: int, dz: torch.Tensor) -> None:
        dz_block(hidden, weight, rows, sc, st.dz, v0, dz, extra)

    return backward_from(
        hidden, weight, fill_dz, st, need_dh=need_dh, need_dw=need_dw, dh_fp32=dh_fp32,
        valid=valid,
    )  # fmt: skip


# --- one shard: custom ops ------------------------------------------------------------------

_Nine = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor,
]  # fmt: skip


@torch.library.custom_op("fusedhead_triton::head_outputs", mutates_args=())
def head_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    gather_ids: torch.Tensor | None, label_offset: int, ignore_index: int, inv_temp: float,
    softcap: float | None, entropy: bool, sum_p2: bool, argmax: bool, top_k: int, settings: str,
) -> _Nine:  # fmt: skip
    """``Values`` of one shard (log_probs, norm, entropy, lse_out, sum_p2, argmax, gathered,
    topk_ids, topk_log_probs)."""
    sc = HeadScalars(label_offset, ignore_index, inv_temp, softcap)
    cfg = Settings.from_key(settings).forward
    v = forward_values(
        hidden, weight, labels, temp, gather_ids, sc, cfg, entropy=entropy, sum_p2=sum_p2,
        argmax=argmax, top_k=top_k,
    )  # fmt: skip
    return tuple(v)  # type: ignore[return-value]


def _head_outputs_fake(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: Any, gather_ids: Any,
    *args: Any,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    entropy, sum_p2, argmax, top_k = args[-5], args[-4], args[-3], args[-2]
    n = hidden.shape[0]

    def make(shape: tuple[int, ...], on: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return hidden.new_empty(shape if on else (0,), dtype=dtype)

    k_g = 0 if gather_ids is None else gather_ids.shape[1]
    return (
        make((n,), True), make((2, n), True), make((n,), entropy), make((n,), True),
        make((n,), sum_p2), make((n,), argmax, torch.int64), make((n, k_g), gather_ids is not None),
        make((n, top_k), top_k > 0, torch.int64), make((n, top_k), top_k > 0),
    )  # fmt: skip


@torch.library.custom_op("fusedhead_triton::head_outputs_backward", mutates_args=())
def head_outputs_backward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sparse_ids: torch.Tensor | None, norm: torch.Tensor, lp: torch.Tensor,
    ent: torch.Tensor | None, sum_p2: torch.Tensor | None, g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    g_lse: torch.Tensor | None, g_p2: torch.Tensor | None, g_sparse: torch.Tensor | None,
    label_offset: int, ignore_index: int, inv_temp: float, softcap: float | None,
    vocab_size: int, settings: str, need_dh: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dh, dW) of one shard; an empty tensor for a gradient not asked."""
    sc = HeadScalars(label_offset, ignore_index, inv_temp, softcap)
    grads = Grads(g_lp, g_ent, g_lse, g_p2, g_sparse)
    dh, dw = backward_values(
        hidden, weight, labels, temp, sparse_ids, norm, lp, ent, sum_p2, grads, sc, vocab_size,
        Settings.from_key(settings), need_dh=need_dh, need_dw=need_dw, dh_fp32=False,
    )  # fmt: skip
    return grads_or_empty(hidden, weight, dh, dw)


def sparse_grads(
    pairs: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (ids, upstream gradient) pairs reached by the loss, side by side: one sparse term."""
    got = [(ids, g) for ids, g in pairs if ids is not None and g is not None]
    if not got:
        return None, None
    if len(got) == 1:
        return got[0][0], _fp32(got[0][1])
    ids = torch.cat([i for i, _ in got], dim=1).contiguous()
    return ids, torch.cat([g.to(torch.float32) for _, g in got], dim=1).contiguous()


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, labels, temp, gather_ids, lo, ig, inv_t, cap, entropy, p2, _, k, key = inputs
    ctx.save_for_backward(
        hidden, weight, labels, temp, gather_ids, output[1], output[0],
        output[2] if entropy else None, output[4] if p2 else None, output[7] if k else None,
    )  # fmt: skip
    ctx.scalars, ctx.entropy, ctx.sum_p2, ctx.settings = (lo, ig, inv_t, cap), entropy, p2, key
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
    hidden, weight, labels, temp, gather_ids, norm, lp, ent, p2, topk_ids = ctx.saved_tensors
    g_lp, _, g_ent, g_lse, g_p2, _, g_gath, _, g_topk = grads
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g_gath = gathered_grad(g_gath, gather_ids, ctx.scalars[1])
    ids, g_sparse = sparse_grads(((gather_ids, g_gath), (topk_ids, g_topk)))
    g = Grads(
        _fp32(g_lp), _fp32(g_ent) if ctx.entropy else None, _fp32(g_lse),
        _fp32(g_p2) if ctx.sum_p2 else None, g_sparse,
    )  # fmt: skip
    none = (None,) * 12
    if all(t is None for t in g) or not (need_dh or need_dw):
        return (None, None, *none)
    lo, ig, inv_t, cap = ctx.scalars
    # vocab_size only bounds the counted ids: one shard holds the whole vocabulary.
    dh, dw = torch.ops.fusedhead_triton.head_outputs_backward(
        hidden, weight, labels, temp, ids, norm, lp, ent, p2, *g, lo, ig, inv_t, cap,
        weight.shape[0] + lo, ctx.settings, need_dh, need_dw,
    )  # fmt: skip
    return (dh if need_dh else None, dw if need_dw else None, *none)


register_pair(
    head_outputs,
    head_outputs_backward,
    forward_fake=_head_outputs_fake,
    setup_context=_setup,
    gradient=_backward,
)


# --- vocab-parallel -------------------------------------------------------------------------


class ShardedOutputs(torch.autograd.Function):
    """The vocab-parallel call (every one, with or without extras): stats gathered across ranks,
    dh all-reduced (in fp32 for 16-bit inputs) with ``reduce``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
        temp: torch.Tensor | None, gather_ids: torch.Tensor | None, sc: HeadScalars,
        st: Settings, flags: tuple[bool, bool, bool], vocab_size: int, group: Any, reduce: bool,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        entropy, sum_p2, argmax = flags
        v = forward_values(
            hidden, weight, labels, temp, gather_ids, sc, st.forward, entropy=entropy,
            sum_p2=sum_p2, argmax=argmax, group=group, vocab_size=vocab_size,
        )  # fmt: skip
        ctx.save_for_backward(
            hidden, weight, labels, temp, gather_ids, v.norm, v.log_probs,
            v.entropy if entropy else None, v.sum_p2 if sum_p2 else None,
        )  # fmt: skip
        ctx.args = (sc, st, flags, vocab_size, group, reduce)
        ctx.mark_non_differentiable(v.argmax)
        ctx.set_materialize_grads(False)
        return v.log_probs, v.entropy, v.lse_out, v.sum_p2, v.argmax, v.gathered

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: its collectives have no derivative here
            raise RuntimeError(DOUBLE_BACKWARD)
        hidden, weight, labels, temp, gather_ids, norm, lp, ent, p2 = ctx.saved_tensors
        sc, st, (entropy, sum_p2, _), vocab_size, group, reduce = ctx.args
        g_lp, g_ent, g_lse, g_p2, _, g_gath = grads
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = Grads(
            _fp32(g_lp), _fp32(g_ent) if entropy else None, _fp32(g_lse),
            _fp32(g_p2) if sum_p2 else None, gathered_grad(g_gath, gather_ids, sc.ignore_index),
        )  # fmt: skip
        none = (None,) * 9
        if all(t is None for t in g):
            return (None, None, *none)
        sum_dh = reduce and need_dh
        dh, dw = backward_values(
            hidden, weight, labels, temp, gather_ids, norm, lp, ent, p2, g, sc, vocab_size, st,
            need_dh=need_dh, need_dw=need_dw,
            dh_fp32=sum_dh and hidden.dtype != torch.float32,
        )  # fmt: skip
        if sum_dh and dh is not None:
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=group)
            dh = dh.to(hidden.dtype)
        return (dh, dw, *none)


def head_outputs_call(
    call: HeadCall, temp: torch.Tensor | None, sc: HeadScalars, st: Settings, key: str
) -> HeadOutput:
    """Every requested output of ``call`` (lse, sum_p2, argmax, gather, top-k with the
    log-probs)."""
    outs = call.outputs
    entropy, lse, p2, arg = (o in outs for o in ("entropy", "lse", "sum_p2", "argmax"))
    ids = call.gather_ids if "gather" in outs else None
    k = call.top_k if "topk" in outs else 0
    hidden, weight, labels = call.hidden, call.weight, call.labels.contiguous()
    if ids is not None:
        ids = ids.contiguous()
    if call.process_group is not None:
        if k:  # the core refuses it first (vocab_parallel_outputs)
            raise ValueError(
                f"top_k: the triton backend computes top-k on one shard only, not under "
                f"process_group (got top_k={k})"
            )
        lp, ent, lse_out, sum_p2, argmax, gathered = ShardedOutputs.apply(  # type: ignore[no-untyped-call]
            hidden, weight, labels, temp, ids, sc, st, (entropy, p2, arg), call.vocab_size,
            call.process_group, call.reduce_hidden_grad,
        )  # fmt: skip
        topk_ids = topk_lp = None
    else:
        res = torch.ops.fusedhead_triton.head_outputs(
            hidden, weight, labels, temp, ids, sc.label_offset, sc.ignore_index, sc.inv_temp,
            sc.softcap, entropy, p2, arg, k, key,
        )  # fmt: skip
        lp, _, ent, lse_out, sum_p2, argmax, gathered, topk_ids, topk_lp = res
    return HeadOutput(
        log_probs=lp,
        entropy=ent if entropy else None,
        lse=lse_out if lse else None,
        sum_p2=sum_p2 if p2 else None,
        argmax=argmax if arg else None,
        gathered=gathered if ids is not None else None,
        topk_ids=topk_ids if k else None,
        topk_log_probs=topk_lp if k else None,
    )
