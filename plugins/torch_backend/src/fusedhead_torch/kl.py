"""Per-token KL between a student head and a teacher head, streamed over vocabulary blocks.

Each tile computes the student's and the teacher's scaled logits of the same rows and vocabulary
columns (two GEMMs; the heads' hidden sizes may differ): ``z = x / T``, or with a head's softcap
``c``, ``z = c tanh(x / c) / T`` (the cap before the temperature, as in ``fused_head``). Per row
and head it keeps the running max ``m`` and ``s = sum exp(z - m)``, plus the cross term of the
direction:

- forward ``KL(p_t || p_s) = sum e_t (d_t - d_s) / s_t - log s_t + log s_s``;
- reverse ``KL(p_s || p_t) = sum e_s (d_s - d_t) / s_s - log s_s + log s_t``,

with the offsets ``d = z - m`` of each head: the maxima never enter, so a large logit's rounding
(an ulp of ``z``, 1.5e-5 at 160) is never left in a KL of a few nats or of 1e-7. The cross term is
weighted by one head's ``e``: merging two blocks rebases it with that head's max and shifts it
by the change of ``d_c - d_o``. Backward
recomputes both tiles: ``dz_s = g (p_s - p_t)`` (forward) or ``g p_s (log p_s - log p_t - KL)``
(reverse), then ``dz_s / T_s`` (times ``1 - tanh^2`` under the student's softcap) enters the two
gradient GEMMs. The teacher gets no gradient. Nothing of size ``[N, V]`` exists; memory is the
tile workspace plus ``O(N)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fusedhead.protocol import KLCall, KLOutput
from fusedhead_torch.chunked import first_order
from fusedhead_torch.grads import TileGrads
from fusedhead_torch.options import fp32_logits, workspace_bytes
from fusedhead_torch.tile_math import (
    FP32,
    Scaling,
    Workspace,
    inverse_temperature,
    logits_mm,
    scale_factor,
)
from fusedhead_torch.tiling import Tiles, plan_tiles, skips_rows

if TYPE_CHECKING:
    from fusedhead_torch.options import TorchOptions

KL_DIRECTIONS = ("forward", "reverse")
#: Workspace bytes per tile element: two GEMM outputs (input dtype) and four fp32 buffers (the
#: student's and the teacher's z, e, and the student's softcap derivative).
_BYTES_PER_ELEMENT = 2 * 4 + 4 * 4


@dataclass(frozen=True)
class KLSpec:
    """Everything about one KL call except its tensors."""

    direction: str
    tiles: Tiles
    #: Logits GEMMs of bf16/fp16 inputs write fp32 (the backend's ``fp32_logits`` setting).
    fp32_logits: bool = False
    softcap: float | None = None  #: the student's
    teacher_softcap: float | None = None


def _z(
    x: torch.Tensor,
    scaling: Scaling,
    r0: int,
    r1: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """A head's ``z = k * src`` of one tile in fp32 (``src``: ``x``, or ``tanh(x / c)``).

    An fp32 tile is worked in place (``x`` itself at ``k = 1``), another goes into ``out``.
    A ``[1, 1]`` fp32 factor, not a Python float, makes a bf16/fp16 tile multiply in fp32.
    """
    src = scaling.source(x, out=x if x.dtype == FP32 else out)
    dst = src if src.dtype == FP32 else out
    k = scaling.rows(r0, r1)
    if dst is src and not isinstance(k, torch.Tensor) and k == 1.0:
        return src
    return torch.mul(src, scale_factor(k, x.device), out=dst)


def _merge(one: list[torch.Tensor], two: list[torch.Tensor], forward: bool) -> list[torch.Tensor]:
    """Two sets of ``[m_s, s_s, m_t, s_t, cross]`` as one: each rebased on the larger maxima, the
    cross term (of offsets ``d = z - m``) also shifted by its offsets' change ``d_c - d_o``."""
    m_s, m_t = torch.maximum(one[0], two[0]), torch.maximum(one[2], two[2])
    s_s, s_t, cross = [torch.zeros_like(m_s) for _ in range(3)]
    for part in (one, two):
        sh_s, sh_t = part[0] - m_s, part[2] - m_t  # <= 0
        a_s, a_t = torch.exp(sh_s), torch.exp(sh_t)
        s_s += part[1] * a_s
        s_t += part[3] * a_t
        if forward:  # weighted by the teacher
            cross += a_t * (part[4] + (sh_t - sh_s) * part[3])
        else:
            cross += a_s * (part[4] + (sh_s - sh_t) * part[1])
    return [m_s, s_s, m_t, s_t, cross]


def _forward_walk(
    hs: torch.Tensor,
    ws_: torch.Tensor,
    ht: torch.Tensor,
    wt: torch.Tensor,
    inv_s: float | torch.Tensor,
    inv_t: float | torch.Tensor,
    spec: KLSpec,
) -> tuple[torch.Tensor, ...]:
    """Per row: student ``m, s``, teacher ``m, s`` and the cross term, over the whole vocabulary."""
    sc_s, sc_t = Scaling(inv_s, spec.softcap), Scaling(inv_t, spec.teacher_softcap)
    n, v = hs.shape[0], ws_.shape[0]
    tiles = spec.tiles
    buf = Workspace(tiles.rows * tiles.cols, hs.device)
    out = [torch.empty(n, dtype=FP32, device=hs.device) for _ in range(5)]
    forward = spec.direction == "forward"
    for r0, r1 in tiles.row_ranges(n):
        rows = r1 - r0
        run: list[torch.Tensor] | None = None  # m_s, s_s, m_t, s_t, cross
        for v0, v1 in tiles.col_ranges(v):
            cols = v1 - v0
            x_s = logits_mm(hs[r0:r1], ws_[v0:v1].T, spec.fp32_logits)
            zs = _z(x_s, sc_s, r0, r1, buf.get(0, rows, cols))
            del x_s
            x_t = logits_mm(ht[r0:r1], wt[v0:v1].T, spec.fp32_logits)
            zt = _z(x_t, sc_t, r0, r1, buf.get(1, rows, cols))
            del x_t
            ms, mt = zs.amax(dim=1), zt.amax(dim=1)
            ds = zs.sub_(ms.unsqueeze(1))  # the offsets d = z - m, in place
            dt = zt.sub_(mt.unsqueeze(1))
            # forward: sum e_t (d_t - d_s); reverse: sum e_s (d_s - d_t)
            a, b = (dt, ds) if forward else (ds, dt)
            diff = torch.sub(a, b, out=buf.get(2, rows, cols))
            es, et = ds.exp_(), dt.exp_()
            ss, st = es.sum(dim=1), et.sum(dim=1)
            cross = diff.mul_(et if forward else es).sum(dim=1)
            if run is None:
                run = [ms, ss, mt, st, cross]
                continue
            run = _merge(run, [ms, ss, mt, st, cross], forward)
        assert run is not None
        for i, val in enumerate(run):
            out[i][r0:r1] = val
    return tuple(out)


def _backward_walk(
    saved: tuple[torch.Tensor, ...],
    inv_s: float | torch.Tensor,
    inv_t: float | torch.Tensor,
    coef: torch.Tensor,
    spec: KLSpec,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Student ``dh`` and ``dW`` from recomputed tiles of both heads."""
    hs, ws_, ht, wt, m_s, s_s, m_t, s_t, mean = saved
    n, v = hs.shape[0], ws_.shape[0]
    tiles = spec.tiles
    buf = Workspace(tiles.rows * tiles.cols, hs.device)
    row_chunks = list(tiles.row_ranges(n))
    blocks = list(tiles.col_ranges(v))
    low = hs.dtype != FP32
    sc_s, sc_t = Scaling(inv_s, spec.softcap), Scaling(inv_t, spec.teacher_softcap)
    capped = spec.softcap is not None
    grads = TileGrads(hs, ws_, len(row_chunks), len(blocks), need_h, need_w)
    forward = spec.direction == "forward"
    # forward: dz = g (e_s / s_s - e_t / s_t); reverse: dz = g e_s / s_s (d_s - d_t - mean), with
    # the offsets d = z - m: log p_s - log p_t - KL without the maxima, the sums or the KL rounded
    a_s = coef / s_s
    a_t = coef / s_t
    shift = -mean
    for v0, v1 in blocks:
        cols = v1 - v0
        w_block = ws_[v0:v1]
        for r0, r1 in row_chunks:
            rows = r1 - r0
            h_rows = hs[r0:r1]
            x_s = logits_mm(h_rows, w_block.T, spec.fp32_logits)
            # the softcap's derivative from x itself (before z may overwrite it): exact at any x
            sech2 = sc_s.sech2(x_s, out=buf.get(3, rows, cols)) if capped else None
            zs = _z(x_s, sc_s, r0, r1, buf.get(0, rows, cols))
            del x_s
            x_t = logits_mm(ht[r0:r1], wt[v0:v1].T, spec.fp32_logits)
            zt = _z(x_t, sc_t, r0, r1, buf.get(1, rows, cols))
            del x_t
            ds = torch.sub(zs, m_s[r0:r1].unsqueeze(1), out=buf.get(2, rows, cols))
            dt = zt.sub_(m_t[r0:r1].unsqueeze(1))
            if forward:
                dz = ds.exp_().mul_(a_s[r0:r1].unsqueeze(1))
                dz.addcmul_(dt.exp_(), a_t[r0:r1].unsqueeze(1), value=-1.0)
            else:
                u = torch.sub(ds, dt, out=dt).add_(shift[r0:r1].unsqueeze(1))
                dz = ds.exp_().mul_(u).mul_(a_s[r0:r1].unsqueeze(1))
            dz.mul_(scale_factor(sc_s.inv_t_rows(r0, r1), hs.device))
            if sech2 is not None:
                dz.mul_(sech2)  # d tanh(y) = sech(y)^2
            grads.add(dz.to(hs.dtype) if low else dz, w_block, h_rows, (r0, r1), (v0, v1))
            del dz
        grads.end_block((v0, v1))
    del buf
    return grads.result()


class ChunkedKL(torch.autograd.Function):
    """Per-row KL of two heads; gradients to the student's hidden and weight only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        valid: torch.Tensor,
        inv_s: float | torch.Tensor,
        inv_t: float | torch.Tensor,
        spec: KLSpec,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        hs, ht = hidden.contiguous(), teacher_hidden.detach().contiguous()
        wt = teacher_weight.detach()
        with torch.no_grad(), torch.autocast(device_type=hs.device.type, enabled=False):
            m_s, s_s, m_t, s_t, cross = _forward_walk(hs, weight, ht, wt, inv_s, inv_t, spec)
        # cross: of the offsets d = z - m, so the maxima never enter (their rounding, an ulp of
        # a large logit, would be the size of a confident pair's whole KL); its mean is what the
        # reverse gradient subtracts from d_s - d_t (log p_s - log p_t - KL, no log s in it)
        if spec.direction == "forward":
            mean = cross / s_t
            kl = mean - torch.log(s_t / s_s)
        else:
            mean = cross / s_s
            kl = mean + torch.log(s_t / s_s)
        kl = torch.where(valid, kl, torch.zeros((), dtype=FP32, device=kl.device))
        ctx.spec = spec
        ctx.inv = tuple(None if isinstance(t, torch.Tensor) else t for t in (inv_s, inv_t))
        ctx.save_for_backward(
            hidden,
            weight,
            ht,
            wt,
            valid,
            m_s,
            s_s,
            m_t,
            s_t,
            mean,
            *(t if isinstance(t, torch.Tensor) else None for t in (inv_s, inv_t)),
        )
        return kl

    @staticmethod
    @first_order
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, ht, wt, valid, m_s, s_s, m_t, s_t, mean, t_s, t_t = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nothing = (None,) * 8
        if g is None or not (need_h or need_w):
            return nothing
        inv_s = t_s if t_s is not None else ctx.inv[0]
        inv_t = t_t if t_t is not None else ctx.inv[1]
        coef = torch.where(valid, g.float(), torch.zeros((), dtype=FP32, device=g.device))
        hs = hidden.contiguous()
        if hs.device.type != "cpu" or torch.compiler.is_compiling() or not bool(valid.all()):
            # Ignored rows read as zeros (max 0, sum 1) in both heads, as the head's backward
            # does: a NaN or inf in one (coefficient 0) must not reach dh or dW through 0 * NaN.
            rows = valid.unsqueeze(1)
            hs = torch.where(rows, hs, torch.zeros((), dtype=hs.dtype, device=hs.device))
            ht = torch.where(rows, ht, torch.zeros((), dtype=ht.dtype, device=ht.device))
            m_s, m_t, mean = (torch.where(valid, t, torch.zeros_like(t)) for t in (m_s, m_t, mean))
            s_s, s_t = (torch.where(valid, t, torch.ones_like(t)) for t in (s_s, s_t))
        saved = (hs, weight, ht, wt, m_s, s_s, m_t, s_t, mean)
        with torch.no_grad(), torch.autocast(device_type=hidden.device.type, enabled=False):
            dh, dw = _backward_walk(saved, inv_s, inv_t, coef, ctx.spec, need_h, need_w)
        return dh, dw, None, None, None, None, None, None


def forward_kl(options: TorchOptions, call: KLCall) -> KLOutput:
    """The per-token KL of ``call`` on the torch backend (ignored rows left out on the CPU)."""
    hs, ws_, ht, wt, valid = (
        call.hidden,
        call.weight,
        call.teacher_hidden,
        call.teacher_weight,
        call.valid,
    )
    n = hs.shape[0]
    inv_s = inverse_temperature(call.temperature, valid)  # an ignored row's reads 1, as the head
    inv_t = inverse_temperature(call.teacher_temperature, valid)
    keep = valid.nonzero().squeeze(1) if skips_rows(options.skip_ignored_rows, hs) else None
    if keep is not None and keep.numel() < n:
        hs, ht, valid = hs.index_select(0, keep), ht.index_select(0, keep), valid[keep]
        inv_s = inv_s.index_select(0, keep) if isinstance(inv_s, torch.Tensor) else inv_s
        inv_t = inv_t.index_select(0, keep) if isinstance(inv_t, torch.Tensor) else inv_t
    else:
        keep = None
    tiles = plan_tiles(
        hs.shape[0],
        ws_.shape[0],
        bytes_per_element=_BYTES_PER_ELEMENT,
        budget_bytes=workspace_bytes(options, hs.device),
        chunk_rows=options.chunk_rows,
        block_vocab=options.block_vocab,
    )
    spec = KLSpec(
        call.direction,
        tiles,
        fp32_logits(options, hs.device),
        softcap=None if call.softcap is None else float(call.softcap),
        teacher_softcap=None if call.teacher_softcap is None else float(call.teacher_softcap),
    )
    # The teacher only read: detached, so a teacher that requires grad (and a student that does
    # not) gives a KL that does not require grad either, as on the triton backend.
    kl = ChunkedKL.apply(hs, ws_, ht.detach(), wt.detach(), valid, inv_s, inv_t, spec)  # type: ignore[no-untyped-call]
    if keep is not None:
        kl = kl.new_zeros(n).index_copy(0, keep, kl)
    return KLOutput(kl)
