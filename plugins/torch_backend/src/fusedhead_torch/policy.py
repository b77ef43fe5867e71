"""The policy loss in three matmuls per token chunk: the reference implementation of the
``policy_loss`` capability (docs/policy-loss.md).

Per chunk of rows: the fp32 logits ``x = h W^T`` (GEMM 1), the rows' max, ``sum exp`` and
entropy, the loss's derivative in each row's log-prob and entropy
(``fusedhead.policy_terms.token_grads``), the logits' gradient ``dz`` in place of the logits, then
``dX = dz W`` (GEMM 2) and ``dW += dz^T h`` (GEMM 3). Memory: the chunk's fp32 tiles (the
workspace budget) and, for 16-bit weights, the weight gradient's fp32 sum besides the two
gradients. Ignored rows are selected out (never multiplied by 0), so a NaN or Inf in their hidden
state reaches nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fusedhead.fp16_range import chunk_scale, hidden_grad, hidden_grad_rows
from fusedhead.grad_sum import WeightGradSum
from fusedhead.policy_terms import label_logit_grad, token_grads
from fusedhead.protocol import PolicyLossCall, PolicyLossResult
from fusedhead_torch.fused_passes import compiled
from fusedhead_torch.tile_math import MAX_SCALE, gemm_operand, logits_mm

FP32 = torch.float32


def chunk_rows(
    v: int,
    dtype: torch.dtype,
    budget_bytes: int,
    softcap: bool,
    explicit: int | None,
    compiled_chunk: bool = False,
) -> int:
    """Rows per chunk: the chunk's tiles within the budget. Eager: two fp32 ``[rows, V]`` tiles,
    a 16-bit one for a 16-bit ``dz``, a third fp32 one with a softcap; compiled (no softcap): the
    fp32 logits and ``dz`` alone, so more rows (fewer roundings of the weight gradient's sum)."""
    if explicit is not None:
        return explicit
    if compiled_chunk and not softcap:
        per_value = 4 + torch.empty((), dtype=dtype).element_size()
    else:
        per_value = 8 + (2 if dtype != FP32 else 0) + (4 if softcap else 0)
    return max(1, budget_bytes // (v * per_value))


#: ``dz`` of a chunk from its per-row coefficients ``(a, b, label)``: ``e a + (e d) b``
#: [* sech^2] in the GEMMs' dtype, its label column not yet patched, and the label column's value
#: ``label`` [* sech^2] in fp32.
ChunkGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
#: What a chunk's elementwise work gives: each row's ``d`` at the label, ``s``, ``log s``, the
#: entropy, and the chunk's ``ChunkGrad``.
ChunkStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ChunkGrad]


def _eager_chunk(
    x: torch.Tensor, k: torch.Tensor, label: torch.Tensor, cap: float | None, need_grads: bool,
    dtype: torch.dtype,
) -> ChunkStats:  # fmt: skip
    """Eager passes over the chunk, worked in place of ``x`` (a softcap's chain factor kept)."""
    sech2 = None
    if cap is not None:
        sech2 = torch.div(x, cap).cosh_().square_().reciprocal_() if need_grads else None
        x.div_(cap).tanh_().mul_(cap)
    # d = (x - max x) k: the max gives d = 0 exactly at any temperature (k x - k max x in one fused
    # multiply-add is off by the rounding of k max x, thousands at T = 1e-10), and near the max,
    # where p is large, x - max x is exact (Sterbenz): d carries one rounding, relative to d.
    d = torch.sub(x, x.amax(dim=1, keepdim=True), out=x).mul_(k.unsqueeze(1))
    e = torch.exp(d)
    s = e.sum(dim=1)
    log_s = torch.log(s)
    ent = log_s - torch.bmm(e.unsqueeze(1), d.unsqueeze(2)).view(-1) / s
    d_y = d.gather(1, label).squeeze(1)

    def grad(
        a: torch.Tensor, b: torch.Tensor, dz_label: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # e a + (e d) b: b d alone overflows at tiny temperatures where e is 0.
        ed = d.mul_(e)
        g = torch.mul(e, a.unsqueeze(1), out=e).addcmul_(ed, b.unsqueeze(1))
        if sech2 is not None:
            dz_label = dz_label * sech2.gather(1, label).squeeze(1)
            g.mul_(sech2)
        return (g.to(dtype) if dtype != FP32 else g), dz_label

    return d_y, s, log_s, ent, grad


def _compiled_chunk(
    x: torch.Tensor, k: torch.Tensor, label: torch.Tensor, cap: float | None, need_grads: bool,
    dtype: torch.dtype,
) -> ChunkStats:  # fmt: skip
    """The same through ``row_stats`` and ``logits_grad`` compiled (no softcap): the fp32 logits
    are read three times and ``dz`` written once, in the GEMMs' dtype."""
    kc = k.unsqueeze(1)
    variant = (x.device.type, x.dtype, dtype)
    m, s, t, d_y = compiled("row_stats", *variant)(x, kc, label)
    log_s = torch.log(s)

    def grad(
        a: torch.Tensor, b: torch.Tensor, dz_label: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dz = compiled("logits_grad", *variant, True)(x, kc, m, a, b, dtype)
        return dz, dz_label

    return d_y, s, log_s, log_s - t / s, grad


def policy_loss(
    call: PolicyLossCall, rows_per_chunk: int, fp32_logits: bool, use_compile: bool = False
) -> PolicyLossResult:
    """Each row's fp32 log-prob and entropy, and the loss's gradients in hidden and weight.

    Passes over a chunk's ``[rows, V]`` values (eager): the GEMM's write, the max,
    ``d = k x - k max`` (one fused multiply-add), ``e = exp(d)``, its sum, ``sum e d`` (a batched
    dot), and for the gradient ``a + b d`` and its product with ``e`` written in the GEMMs' dtype;
    the label column is patched from ``[rows]`` values (one rounding). ``use_compile`` (no
    softcap) fuses them through ``torch.compile``.
    """
    head = call.head
    hidden, weight, labels = head.hidden, head.weight, head.labels
    n = hidden.shape[0]
    device = hidden.device
    temp = head.temperature
    valid = labels != head.ignore_index
    inv_t = (
        # An ignored row's temperature is never read (an unchecked call may pass NaN or 0 there).
        torch.where(valid, 1.0 / temp.to(FP32), 1.0).clamp_(max=MAX_SCALE)
        if isinstance(temp, torch.Tensor)
        else torch.full((1,), min(1.0 / float(temp), MAX_SCALE), dtype=FP32, device=device)
    )
    chunk = _compiled_chunk if use_compile and head.softcap is None else _eager_chunk
    zero = torch.zeros((), dtype=FP32, device=device)
    nan = torch.full((), math.nan, dtype=FP32, device=device)
    v = weight.shape[0]
    w_t = gemm_operand(weight, fp32_logits).t()
    log_probs = torch.empty(n, dtype=FP32, device=device)
    entropy = torch.empty(n, dtype=FP32, device=device)
    grad_h = hidden_grad(hidden) if call.need_hidden_grad else None
    grad_w = WeightGradSum(weight) if call.need_weight_grad else None
    need_grads = grad_h is not None or grad_w is not None
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        ok = valid[start:stop]
        # Ignored rows' hidden states are selected out: a NaN or Inf there reaches nothing.
        h_rows = torch.where(
            ok.unsqueeze(1), hidden[start:stop], torch.zeros((), dtype=hidden.dtype)
        )
        x = logits_mm(gemm_operand(h_rows, fp32_logits), w_t, fp32_logits).to(FP32)
        k = inv_t[start:stop] if inv_t.numel() > 1 else inv_t.expand(stop - start)
        y = labels[start:stop]
        # An unchecked call's out-of-range label is never read out of bounds: its row gives NaN.
        in_range = ok & (y >= 0) & (y < v)
        label = torch.where(in_range, y, 0).unsqueeze(1)
        d_y, s, log_s, ent, grad = chunk(x, k, label, head.softcap, need_grads, hidden.dtype)
        lp = torch.where(in_range, d_y - log_s, torch.where(ok, nan, zero))
        ent = torch.where(ok, ent, zero)
        log_probs[start:stop] = lp
        entropy[start:stop] = ent
        if not need_grads:
            del grad, x  # the chunk's tiles, before the next chunk's logits
            continue
        terms = token_grads(call, start, stop, lp, ent)
        g_lp, g_ent = terms.grad_log_probs, terms.grad_entropy
        scale = chunk_scale(hidden.dtype, g_lp, g_ent, ent, k)  # fp16: dz in range; else 1
        if scale != 1.0:
            g_lp, g_ent = g_lp * scale, g_ent * scale
        # dL/dx_j = k (g_lp (onehot - p_j) - g_ent p_j (log p_j + H)) [* sech^2], with p = e / s
        # and log p = d - log s: e (a + b d), k folded into a and b; the label column from the
        # row's log-prob (policy_terms.label_logit_grad).
        inv_s = k / s
        a = (-g_lp - g_ent * (ent - log_s)) * inv_s
        b = -g_ent * inv_s
        dz, dz_label = grad(a, b, k * label_logit_grad(lp, ent, g_lp, g_ent))
        del grad, x  # the chunk's fp32 tiles but dz, before the gradient GEMMs
        dz.scatter_(1, label, dz_label.to(dz.dtype).unsqueeze(1))
        if grad_h is not None:
            hidden_grad_rows(dz, weight, grad_h[start:stop], scale)
        if grad_w is not None:
            grad_w.add(dz, h_rows, alpha=1.0 / scale, only=start == 0 and stop == n)
    return PolicyLossResult(
        log_probs, entropy, grad_hidden=grad_h,
        grad_weight=None if grad_w is None else grad_w.result(),
    )  # fmt: skip
