"""The autograd Function: forward keeps per-row statistics, backward recomputes logit tiles.

Every GEMM is an aten ``mm`` through the dispatcher (``aten::mm``; with ``fp32_logits`` on CUDA
the logits GEMMs are ``aten::mm.dtype``, elsewhere upcast operands and ``aten::mm``), so dispatcher
overrides (batch-invariant or deterministic modes) take effect in forward and backward alike.
Softmax and entropy math runs in fp32 on one tile at a time; nothing of size ``[N, V]`` is ever
held. The weight gradient of a vocabulary block is finished (accumulated in fp32 over row chunks
when there are several) before the next block starts, so no ``[V, H]`` fp32 buffer exists.

Ignored rows (label ``ignore_index``) get exactly zero gradients even when their hidden state holds
NaN or inf: backward reads their hidden rows and row max as zeros, so every product with them is a
finite zero (the weight gradient never sees them).

No backward is differentiable (``first_order``): under ``create_graph=True`` the gradients come
back attached to a node that raises ``DOUBLE_BACKWARD`` when a gradient of them is asked for,
never a silently first-order (or detached) one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.second_order import first_order as _first_order
from fusedhead_torch.grads import TileGrads
from fusedhead_torch.parallel import all_reduce_tile_stats
from fusedhead_torch.rowstats import TileStats, combine_tiles
from fusedhead_torch.tile_math import (
    FP32,
    Scaling,
    Workspace,
    backward_tile,
    clamp_scale,
    compiled_backward_tile,
    forward_logits,
    forward_tile,
    gemm_operand,
    logits_mm,
)
from fusedhead_torch.tiling import Tiles


@dataclass(frozen=True)
class HeadSpec:
    """Everything about one call except its tensors."""

    ignore_index: int
    return_entropy: bool
    softcap: float | None
    tiles: Tiles
    vocab_start: int
    vocab_size: int
    process_group: Any = None
    reduce_hidden_grad: bool = True
    #: Logits GEMMs accumulate and write fp32 (bf16/fp16 inputs); gradient GEMMs stay as they are.
    fp32_logits: bool = False
    #: The backward's ``dz`` through one compiled pass (``fused_passes``; no softcap).
    compile_dz: bool = False
    #: The forward's tiles (``tiling.GRID_COLS`` columns: the vocabulary grid); None: ``tiles``.
    forward_tiles: Tiles | None = None

    @property
    def grid_tiles(self) -> Tiles:
        """The tiles the forward walks (its statistics are those of the grid's tiles)."""
        return self.tiles if self.forward_tiles is None else self.forward_tiles


@dataclass(frozen=True)
class LabelPlace:
    """Where each row's label sits in this rank's shard: block index (-1: not here) and column."""

    valid: torch.Tensor
    block: torch.Tensor
    col: torch.Tensor

    @classmethod
    def locate(
        cls, labels: torch.Tensor, v_local: int, spec: HeadSpec, tiles: Tiles | None = None
    ) -> LabelPlace:
        """Place labels (global ids) in the blocks of ``tiles`` (default ``spec.tiles``) over
        this shard."""
        cols = (spec.tiles if tiles is None else tiles).cols
        valid = labels != spec.ignore_index
        local = labels - spec.vocab_start
        owned = valid & (local >= 0) & (local < v_local)
        safe = torch.where(owned, local, torch.zeros_like(local))
        block = torch.where(owned, safe // cols, torch.full_like(local, -1))
        return cls(valid, block, safe % cols)

    def tile(self, b: int, start: int, stop: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows ``[start, stop)`` of block ``b``: in-block mask and a clamped column."""
        return self.block[start:stop] == b, self.col[start:stop].clamp(max=width - 1)


def _forward_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    place: LabelPlace,
    scaling: Scaling,
    spec: HeadSpec,
) -> tuple[TileStats, torch.Tensor]:
    """Statistics of every row in each grid tile of this shard (``[T, N]``), and the label logit
    (0 where not owned); ``place`` is located in ``spec.grid_tiles``."""
    n, v = h.shape[0], weight.shape[0]
    tiles = spec.grid_tiles
    ws = Workspace(tiles.rows * tiles.cols, h.device)
    blocks = list(tiles.col_ranges(v)) if v else []
    m, s, t = (torch.empty(len(blocks), n, dtype=FP32, device=h.device) for _ in range(3))
    z_label = torch.zeros(n, dtype=FP32, device=h.device)
    for r0, r1 in tiles.row_ranges(n):
        h_rows = gemm_operand(h[r0:r1], spec.fp32_logits)
        k = scaling.rows(r0, r1)
        for b, (v0, v1) in enumerate(blocks):
            x = logits_mm(h_rows, weight[v0:v1].T, spec.fp32_logits)
            in_block, col = place.tile(b, r0, r1, v1 - v0)
            stats, z_y = forward_tile(x, col, k, scaling, ws, spec.return_entropy)
            del x
            m[b, r0:r1], s[b, r0:r1], t[b, r0:r1] = stats.m, stats.s, stats.t
            z_label[r0:r1] = torch.where(in_block, z_y, z_label[r0:r1])
    return TileStats(m, s, t), z_label


def _coefficients(
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    stats: tuple[torch.Tensor, torch.Tensor | None],
    place: LabelPlace,
    inv_t: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row ``a``, ``b``, ``label_term`` with ``dz_x = e * (a + b * d) + onehot * label_term``.

    Here ``d = z - m`` and ``e = exp(d)``, so ``p = e / s`` and ``log p = d - log s``. From
    ``dz = g_lp * (onehot - p) - g_H * p * (log p + H)`` and ``dz_x = dz / T``, the ``1 / s`` and
    ``log s`` fold into ``a`` and ``b``: the tile never needs ``log p`` itself, whose fp32 value
    would carry the rounding of ``lse = m + log s`` (about ``u |z|``) into every ``p``. Ignored rows
    get zeros, and a label that no column of this shard holds gets no one-hot term.
    """
    s, entropy = stats
    zero = torch.zeros((), dtype=FP32, device=place.valid.device)
    gl = None if g_lp is None else torch.where(place.valid, g_lp.float(), zero)
    gh = None if g_ent is None or entropy is None else torch.where(place.valid, g_ent.float(), zero)
    inv_s = s.reciprocal()
    if gh is not None and entropy is not None:
        a = gh * entropy if gl is None else torch.addcmul(gl, gh, entropy)
        b = (gh * inv_t).neg_()
        a = a.mul_(inv_t).neg_().sub_(b * torch.log(s))
        coef_a, coef_b = a.mul_(inv_s), b.mul_(inv_s)
    else:
        assert gl is not None
        coef_a, coef_b = (gl * inv_t).neg_().mul_(inv_s), None
    if gl is None:
        label_term = torch.zeros_like(coef_a)
    else:
        label_term = torch.where(place.block >= 0, gl * inv_t, zero)
    return coef_a, coef_b, label_term


def _backward_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    place: LabelPlace,
    scaling: Scaling,
    spec: HeadSpec,
    row_max: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dh`` (summed over the group if asked) and ``dW`` in the input dtype.

    Each tile's ``dz`` is recomputed (``backward_tile``) and enters the gradient GEMMs of
    ``TileGrads``; the tile buffers are gone by the all-reduce: only dh (fp32), its cast and dW
    are alive at the end.
    """
    n, v = h.shape[0], weight.shape[0]
    tiles = spec.tiles
    row_chunks = list(tiles.row_ranges(n))
    blocks = list(tiles.col_ranges(v))
    ws = Workspace(tiles.rows * tiles.cols, h.device)
    coef_a, coef_b, label_term = coefs
    grads = TileGrads(h, weight, len(row_chunks), len(blocks), need_h, need_w)
    h_mm = gemm_operand(h, spec.fp32_logits)  # the recompute's operand (upcast once if need be)
    fused = spec.compile_dz and spec.softcap is None
    for b, (v0, v1) in enumerate(blocks):
        w_block = weight[v0:v1]
        for r0, r1 in row_chunks:
            in_block, col = place.tile(b, r0, r1, v1 - v0)
            b_rows = None if coef_b is None else coef_b[r0:r1]
            # the forward's logits, bit for bit: its tiles' GEMMs (forward_logits)
            x = forward_logits(h_mm, weight, (r0, r1), (v0, v1), spec.grid_tiles, spec.fp32_logits)
            k = scaling.rows(r0, r1)
            coef_rows = (coef_a[r0:r1], b_rows, label_term[r0:r1])
            if fused:
                dz = compiled_backward_tile(x, col, in_block, k, row_max[r0:r1], coef_rows, h.dtype)
            else:
                dz = backward_tile(
                    x, col, in_block, k, scaling, ws, row_max[r0:r1], *coef_rows, dz_dtype=h.dtype
                )
            del x
            grads.add(dz, w_block, h[r0:r1], (r0, r1), (v0, v1))
            del dz
        grads.end_block((v0, v1))
    del ws, h_mm  # the tiles and an upcast hidden are freed before the all-reduce and the cast
    return grads.result(spec.process_group, spec.reduce_hidden_grad)


DOUBLE_BACKWARD = (
    "the torch backend's backward is not differentiable: a double backward (create_graph=True, "
    "then a gradient of that gradient, e.g. a gradient penalty through the log-probs, an extra "
    "output or the KL) is not supported; form such a term from full logits (hidden @ weight.T) "
    "with plain PyTorch ops"
)

#: Every backward of the backend (the head, the outputs past it, the KL): run without grad; under
#: ``create_graph=True`` its gradients come back tied to the Function's saved inputs through a node
#: that raises ``DOUBLE_BACKWARD`` when they are differentiated, however that is asked for
#: (``backward()``, or ``torch.autograd.grad`` of chosen inputs): never a silently first-order one.
first_order = _first_order(DOUBLE_BACKWARD)


def _no_autocast(device: torch.device) -> torch.autocast:
    """GEMMs in the dtype of the tensors given, whatever autocast region the caller is in."""
    return torch.autocast(device_type=device.type, enabled=False)


class ChunkedFusedHead(torch.autograd.Function):
    """``(log_probs, entropy)`` of ``hidden [N, H]`` and ``weight [V_local, H]``; see module doc."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        inv_t: float | torch.Tensor,
        spec: HeadSpec,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        ctx.set_materialize_grads(False)
        h = hidden.contiguous()
        inv_t = clamp_scale(inv_t)  # the core refuses T below 1 / MAX_SCALE (min_temperature)
        scaling = Scaling(inv_t, spec.softcap)
        place = LabelPlace.locate(labels, weight.shape[0], spec, spec.grid_tiles)
        with _no_autocast(h.device):
            tile_stats, z_label = _forward_stats(h, weight, place, scaling, spec)
        if spec.process_group is not None and h.shape[0] > 0:  # every rank has the same rows
            shard = (spec.vocab_start, weight.shape[0], spec.vocab_size)
            stats, z_label, _ = all_reduce_tile_stats(
                tile_stats, z_label, spec.process_group, shard
            )
        else:
            stats = combine_tiles(tile_stats)[0]
        zero = torch.zeros((), dtype=FP32, device=h.device)
        # (z_y - m) - log s, not z_y - lse: lse = m + log s would round away a small log s.
        log_probs = torch.where(place.valid, (z_label - stats.m).sub_(torch.log(stats.s)), zero)
        out_of_range = place.valid & ((labels < 0) | (labels >= spec.vocab_size))
        log_probs = torch.where(out_of_range, torch.full_like(zero, math.nan), log_probs)
        entropy = stats.entropy() if spec.return_entropy else None
        ctx.spec = spec
        ctx.inv_t = inv_t if not isinstance(inv_t, torch.Tensor) else None
        ctx.save_for_backward(
            hidden,
            weight,
            labels,
            stats.m,
            stats.s,
            entropy,
            inv_t if isinstance(inv_t, torch.Tensor) else None,
        )
        if entropy is None:
            return log_probs
        return log_probs, torch.where(place.valid, entropy, zero)

    @staticmethod
    @first_order
    def backward(
        ctx: Any, g_lp: torch.Tensor | None, *rest: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, labels, row_max, row_sum, entropy, inv_t_tensor = ctx.saved_tensors
        spec: HeadSpec = ctx.spec
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_ent = rest[0] if rest else None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        inv_t = inv_t_tensor if inv_t_tensor is not None else ctx.inv_t
        scaling = Scaling(inv_t, spec.softcap)
        place = LabelPlace.locate(labels, weight.shape[0], spec)
        h = hidden.contiguous()
        # On the CPU, checking is free; on CUDA it would sync and under torch.compile it is a
        # data-dependent branch, so the rows are always masked there.
        if h.device.type != "cpu" or torch.compiler.is_compiling() or not bool(place.valid.all()):
            # Ignored rows read as zeros: a NaN in one (whose coefficients are 0) must reach
            # neither dh nor dW through 0 * NaN; their statistics become those of zero logits.
            valid = place.valid
            zero = torch.zeros((), dtype=h.dtype, device=h.device)
            h = torch.where(valid.unsqueeze(1), h, zero)
            row_max = torch.where(valid, row_max, torch.zeros_like(row_max))
            row_sum = torch.where(valid, row_sum, torch.ones_like(row_sum))
            if entropy is not None:
                entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
        coefs = _coefficients(g_lp, g_ent, (row_sum, entropy), place, inv_t)
        # A backward() called under autocast must not turn the gradient GEMMs to lower precision.
        with _no_autocast(hidden.device):
            dh, dw = _backward_grads(
                h, weight, place, scaling, spec, row_max, coefs, need_h, need_w
            )
        return dh, dw, None, None, None
