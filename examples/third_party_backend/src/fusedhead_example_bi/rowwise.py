"""The math: a batch-invariant forward (one row at a time) and a blocked backward.

Why the forward is batch invariant: every floating-point operation that produces a row's result
takes only that row's data, with shapes that do not depend on N. For each vocabulary block (a
fresh fp32 copy of ``weight[v0:v1]``), the row is copied into one fp32 buffer and multiplied by
``torch.mv`` (the same kernel, the same shapes, the same alignment for every row), then the
row's running max, sum of exponentials and sum of ``p z`` are updated with vector ops of length
``v1 - v0``. Nothing is reduced across rows and nothing is tiled over N, so a row gives the same
bits alone, in any batch, at any position. The backward (not covered by batch invariance) uses
GEMMs over vocabulary blocks, recomputing the logits from the saved per-row log-sum-exp.
"""

from __future__ import annotations

from typing import Any

import torch


def _row_stats(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, vocab_block: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Per-row log-sum-exp and entropy in fp32, and the fp32 weight blocks (reused for labels)."""
    n, h = hidden.shape
    v = weight.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
    row = torch.empty(h, dtype=torch.float32, device=hidden.device)
    blocks = [
        weight[v0 : v0 + vocab_block].to(torch.float32, copy=True)
        for v0 in range(0, v, vocab_block)
    ]
    outs = [torch.empty(b.shape[0], dtype=torch.float32, device=hidden.device) for b in blocks]
    for i in range(n):
        row.copy_(hidden[i])
        m: torch.Tensor | None = None
        s = sz = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for block, z in zip(blocks, outs):
            torch.mv(block, row, out=z)
            z.div_(temperature)
            bm = z.max()
            if m is None:
                m = bm
                e = torch.exp(z - m)
                s, sz = e.sum(), (e * z).sum()
            else:
                new = torch.maximum(m, bm)
                scale = torch.exp(m - new)
                e = torch.exp(z - new)
                s = s * scale + e.sum()
                sz = sz * scale + (e * z).sum()
                m = new
        assert m is not None and s is not None and sz is not None
        lse[i] = m + torch.log(s)
        ent[i] = lse[i] - sz / s
    return lse, ent, blocks


def _label_logits(
    hidden: torch.Tensor,
    blocks: list[torch.Tensor],
    labels: torch.Tensor,
    vocab_block: int,
    temperature: float,
) -> torch.Tensor:
    """z_y per row, each a length-H dot product of fp32 copies (0 where the label is out of range)."""
    n = hidden.shape[0]
    out = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    row = torch.empty(hidden.shape[1], dtype=torch.float32, device=hidden.device)
    v = sum(b.shape[0] for b in blocks)
    for i, y in enumerate(labels.tolist()):
        if 0 <= y < v:
            row.copy_(hidden[i])
            out[i] = torch.dot(blocks[y // vocab_block][y % vocab_block], row) / temperature
    return out


class RowwiseFusedHead(torch.autograd.Function):
    """Forward row by row (batch invariant); backward with blocked GEMMs, only for what is asked."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        ignore_index: int,
        vocab_block: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lse, ent, blocks = _row_stats(hidden, weight, temperature, vocab_block)
        z_y = _label_logits(hidden, blocks, labels, vocab_block, temperature)
        v = weight.shape[0]
        valid = labels != ignore_index
        in_range = (labels >= 0) & (labels < v)
        log_probs = torch.where(valid, z_y - lse, 0.0)
        log_probs = torch.where(valid & ~in_range, float("nan"), log_probs)
        entropy = torch.where(valid, ent, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.ignore_index, ctx.vocab_block = temperature, ignore_index, vocab_block
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_h or want_w):
            return None, None, None, None, None, None
        t = ctx.temperature
        valid = (labels != ctx.ignore_index) & (labels >= 0) & (labels < weight.shape[0])
        zero = torch.zeros_like(lse)
        g_lp = torch.where(valid, zero if g_lp is None else g_lp.float(), 0.0).unsqueeze(-1)
        g_ent = torch.where(valid, zero if g_ent is None else g_ent.float(), 0.0).unsqueeze(-1)
        # ignored rows selected out before the GEMMs: a NaN or Inf hidden state there reaches
        # nothing (a zero upstream alone would give 0 * NaN)
        keep = valid.unsqueeze(-1)
        h32 = torch.where(keep, hidden.float(), 0.0)
        dh = torch.zeros_like(h32) if want_h else None
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if want_w else None
        lse_ = torch.where(keep, lse.unsqueeze(-1), 0.0)
        ent_ = torch.where(keep, entropy.unsqueeze(-1), 0.0)
        for v0 in range(0, weight.shape[0], ctx.vocab_block):
            w32 = weight[v0 : v0 + ctx.vocab_block].float()
            logp = (h32 @ w32.T) / t - lse_
            p = logp.exp()
            dz = -g_lp * p - g_ent * p * (logp + ent_)
            local = labels - v0
            hit = valid & (local >= 0) & (local < w32.shape[0])
            rows = hit.nonzero().squeeze(-1)
            dz[rows, local[rows]] += g_lp[rows, 0]
            dz = dz / t
            if dh is not None:
                dh += dz @ w32
            if dw is not None:
                dw[v0 : v0 + ctx.vocab_block] = (dz.T @ h32).to(weight.dtype)
        return (None if dh is None else dh.to(hidden.dtype)), dw, None, None, None, None
