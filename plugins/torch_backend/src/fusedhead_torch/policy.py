"""The policy loss in three matmuls per token chunk: the reference implementation of the
``policy_loss`` capability (docs/policy-loss.md).

Per chunk of rows: the fp32 logits ``x = h W^T`` (GEMM 1), the rows' max, ``sum exp`` and
entropy, the loss's derivative in each row's log-prob and entropy
(``fusedhead.policy_terms.token_grads``), the logits' gradient ``dz`` in place of the logits, then
``dX = dz W`` (GEMM 2) and ``dW += dz^T h`` (GEMM 3). Memory: the chunk's fp32 tiles (the
workspace budget) besides the two gradients. Ignored rows are selected out (never multiplied by
0), so a NaN or Inf in their hidden state reaches nothing.
"""

from __future__ import annotations

import torch

from fusedhead.policy_terms import token_grads
from fusedhead.protocol import PolicyLossCall, PolicyLossResult
from fusedhead_torch.tile_math import MAX_SCALE, gemm_operand, logits_mm

FP32 = torch.float32


def chunk_rows(v: int, budget_bytes: int, softcap: bool, explicit: int | None) -> int:
    """Rows per chunk: two fp32 ``[rows, V]`` tiles (three with a softcap) within the budget."""
    if explicit is not None:
        return explicit
    per_row = v * 4 * (3 if softcap else 2)
    return max(1, budget_bytes // per_row)


def policy_loss(call: PolicyLossCall, rows_per_chunk: int, fp32_logits: bool) -> PolicyLossResult:
    """Each row's fp32 log-prob and entropy, and the loss's gradients in hidden and weight."""
    head = call.head
    hidden, weight, labels = head.hidden, head.weight, head.labels
    n = hidden.shape[0]
    device = hidden.device
    temp = head.temperature
    inv_t: float | torch.Tensor = (
        (1.0 / temp.to(FP32)).clamp_(max=MAX_SCALE)
        if isinstance(temp, torch.Tensor)
        else min(1.0 / float(temp), MAX_SCALE)
    )
    cap = head.softcap
    valid = labels != head.ignore_index
    zero = torch.zeros((), dtype=FP32, device=device)
    w_op = gemm_operand(weight, fp32_logits)
    w_t = w_op.t()
    log_probs = torch.empty(n, dtype=FP32, device=device)
    entropy = torch.empty(n, dtype=FP32, device=device)
    grad_h = torch.empty_like(hidden) if call.need_hidden_grad else None
    grad_w = torch.zeros_like(weight) if call.need_weight_grad else None
    need_grads = grad_h is not None or grad_w is not None
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        rows_valid = valid[start:stop]
        keep = rows_valid.unsqueeze(1)
        h_rows = torch.where(keep, hidden[start:stop], torch.zeros((), dtype=hidden.dtype))
        x = logits_mm(gemm_operand(h_rows, fp32_logits), w_t, fp32_logits).to(FP32)
        k = inv_t[start:stop].unsqueeze(1) if isinstance(inv_t, torch.Tensor) else inv_t
        sech2 = None
        if cap is not None:
            sech2 = torch.div(x, cap).cosh_().square_().reciprocal_() if need_grads else None
            x.div_(cap).tanh_().mul_(cap)
        d = x.mul_(k)  # z = k * src; then d = z - max, in place
        d.sub_(d.amax(dim=1, keepdim=True))
        e = torch.exp(d)
        s = e.sum(dim=1)
        log_s = torch.log(s)
        label = torch.where(rows_valid, labels[start:stop], 0).unsqueeze(1)
        ent = log_s - (e * d).sum(dim=1) / s
        lp = d.gather(1, label).squeeze(1) - log_s
        lp = torch.where(rows_valid, lp, zero)
        ent = torch.where(rows_valid, ent, zero)
        log_probs[start:stop] = lp
        entropy[start:stop] = ent
        if not need_grads:
            continue
        terms = token_grads(call, start, stop, lp, ent)
        g_lp, g_ent = terms.grad_log_probs, terms.grad_entropy
        # dL/dz_j = g_lp (onehot - p_j) - g_ent p_j (log p_j + H), with p = e / s and
        # log p = d - log s: e * (a + b d) + onehot * g_lp.
        inv_s = 1.0 / s
        a = (-g_lp - g_ent * (ent - log_s)) * inv_s
        b = -g_ent * inv_s
        dz = d.mul_(b.unsqueeze(1)).add_(a.unsqueeze(1)).mul_(e)
        del e
        dz.scatter_add_(1, label, torch.where(rows_valid, g_lp, zero).unsqueeze(1))
        dz.mul_(k)  # dz/dx = k (times the softcap's sech^2)
        if sech2 is not None:
            dz.mul_(sech2)
            del sech2
        dz.masked_fill_(~keep, 0.0)  # selected, not multiplied: NaN rows give exact zeros
        dz_op = dz.to(hidden.dtype) if hidden.dtype != FP32 else dz
        if grad_h is not None:
            grad_h[start:stop] = torch.mm(dz_op, weight)
        if grad_w is not None:
            grad_w.addmm_(dz_op.t(), h_rows)
    return PolicyLossResult(log_probs, entropy, grad_hidden=grad_h, grad_weight=grad_w)
