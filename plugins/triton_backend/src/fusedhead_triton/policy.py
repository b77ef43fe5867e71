"""The policy loss in three GEMMs per row chunk (the ``policy_loss`` capability).

Per chunk: the logits GEMM with the forward's statistics in its epilogue, each tile's offsets
``d = z - m_tile`` kept (``kernels.policy``); the fixed-order combine of the plain head (so the
log-probs and entropies are the plain head's bits); the loss's derivative per row
(``fusedhead.policy_terms.token_grads``); ``dz`` in place of the kept offsets; then cuBLAS for
``dX = dz W`` and ``dW += dz^T h``, the latter into an fp32 sum rounded once at the end
(``fusedhead.grad_sum``; the kept buffer is let go first). The kept offsets and ``dz`` share one
``[rows, V]`` buffer of two bytes per value for 16-bit inputs (fp16 offsets: within
``2^-11 / e`` of a probability); with a softcap, four (the raw logits, ``kernels.policy``).
"""

from __future__ import annotations

import math

import torch

from fusedhead.fp16_range import chunk_scale, hidden_grad, hidden_grad_rows
from fusedhead.grad_sum import WeightGradSum
from fusedhead.policy_terms import label_logit_grad, token_grads
from fusedhead.protocol import PolicyLossCall, PolicyLossResult

from .configs import Settings
from .kernels.policy import policy_dz_kernel, policy_logits_kernel
from .launch import (
    HeadScalars,
    Partials,
    combine_extras,
    descriptor,
    num_programs,
    tile_constants,
    tma_usable,
)

#: The dz kernel's rows per program, warps and load stages (its columns: the GEMM's tile width).
DZ_CONFIG = (2, 4, 3)
FP32 = torch.float32


def keep_dtype(dtype: torch.dtype, softcap: bool = False) -> torch.dtype:
    """What the offsets are kept in: fp16 beside 16-bit inputs (their dz has the same size, and
    is written in place), fp32 beside fp32 inputs; with a softcap, the raw logits in fp32 (the
    16-bit dz then in the first half of each row's bytes)."""
    return FP32 if dtype == FP32 or softcap else torch.float16


def kept_budget(memory_bytes: int, weight: torch.Tensor, need_weight_grad: bool) -> int:
    """The kept buffer's bound: ``memory_bytes``, or a 16-bit weight gradient's size where that
    is more and the gradient is asked. Its fp32 sum is rounded into a copy of that size after the
    buffer is let go, so a buffer up to that size adds nothing to the peak, and fewer chunks are
    fewer read-modify-writes of the sum."""
    if not need_weight_grad:
        return memory_bytes
    return max(memory_bytes, WeightGradSum.rounding_bytes(weight))


def chunk_rows(
    n: int, v: int, dtype: torch.dtype, budget_bytes: int, explicit: int | None,
    softcap: bool = False, one_chunk_bytes: int = 0,
) -> int:  # fmt: skip
    """Rows per chunk: as few chunks as the kept ``[rows, V]`` buffer within ``budget_bytes``
    allows (at least 128 rows), of equal size in whole 128-row tiles, so no small last chunk
    pays a GEMM of its own at low efficiency and a read-modify-write of the weight gradient.
    All ``n`` rows in one chunk where their buffer is within ``one_chunk_bytes``
    (``one_chunk_budget``)."""
    if explicit is not None:
        return explicit
    per_row = v * torch.empty((), dtype=keep_dtype(dtype, softcap)).element_size()
    if max(n, 1) * per_row <= one_chunk_bytes:
        return max(n, 1)
    most = max(128, budget_bytes // per_row // 128 * 128)
    chunks = math.ceil(max(n, 1) / most)
    rows = math.ceil(max(n, 1) / chunks / 128) * 128
    return min(rows, max(n, 1))


def one_chunk_budget(budget_bytes: int, weight: torch.Tensor, need_weight_grad: bool) -> int:
    """The kept buffer's bound for the rows in one chunk: with a bf16 weight gradient asked, that
    chunk's one GEMM rounds the gradient itself (``WeightGradSum.add(only=True)``), so the fp32
    sum (twice the gradient) is never held, read, written or rounded, and a buffer up to
    ``budget_bytes`` plus the gradient's size peaks no higher than chunks beside the sum (the sum
    and the larger of the buffer and its rounded copy). 0 otherwise (fp16 keeps its fp32 sum)."""
    if not need_weight_grad or weight.dtype != torch.bfloat16:
        return 0
    return budget_bytes + WeightGradSum.rounding_bytes(weight)


def policy_loss(call: PolicyLossCall, st: Settings, rows_per_chunk: int) -> PolicyLossResult:
    """Each row's fp32 log-prob and entropy, and the loss's gradients in hidden and weight."""
    head = call.head
    hidden, weight, labels = head.hidden, head.weight, head.labels.contiguous()
    (n, h), v = hidden.shape, weight.shape[0]
    dev = hidden.device
    cfg = st.forward
    temp = None
    inv_temp = 1.0
    if isinstance(head.temperature, torch.Tensor):
        temp = head.temperature.detach().to(device=dev, dtype=FP32).expand(n).contiguous()
    else:
        inv_temp = 1.0 / float(head.temperature)
    softcap = None if head.softcap is None else float(head.softcap)
    sc = HeadScalars(0, head.ignore_index, inv_temp, softcap)
    valid = labels != head.ignore_index
    log_probs = torch.empty(n, dtype=FP32, device=dev)
    entropy = torch.empty(n, dtype=FP32, device=dev)
    grad_h = hidden_grad(hidden) if call.need_hidden_grad else None
    grad_w = WeightGradSum(weight) if call.need_weight_grad else None
    rows = min(rows_per_chunk, n)
    buf = torch.empty(rows * v, dtype=keep_dtype(hidden.dtype, softcap is not None), device=dev)
    tiles = math.ceil(v / cfg.block_n)
    tma = tma_usable(cfg, hidden.dtype, h, dev)
    w_arg = descriptor(weight, [cfg.block_n, cfg.block_k]) if tma else weight
    progs = num_programs(dev)
    flags = tile_constants(
        cfg, hidden.dtype, PER_TOKEN_T=temp is not None, HAS_SOFTCAP=softcap is not None
    )
    cap_args = sc.softcap_args
    zero = torch.zeros((), dtype=hidden.dtype, device=dev)
    keep = dz = keep_arg = buf  # views of the kept buffer, bound whatever the loop runs
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        m = stop - start
        ok = valid[start:stop]
        # Ignored rows' hidden states are selected out: a NaN or Inf there reaches nothing.
        h_rows = torch.where(ok.unsqueeze(1), hidden[start:stop], zero)
        y = labels[start:stop]
        t_rows = temp[start:stop] if temp is not None else log_probs  # a dummy unless per-token
        keep = buf[: m * v].view(m, v)
        # (not an fp32 tile beside 16-bit operands: its staging would not fit shared memory)
        keep_tma = (
            tma
            and keep.element_size() == hidden.element_size()
            and (v * keep.element_size()) % 16 == 0
            and keep.data_ptr() % 16 == 0
        )
        keep_arg = descriptor(keep, [cfg.block_m, cfg.block_n]) if keep_tma else keep
        ws = torch.empty((3, tiles, m), dtype=FP32, device=dev)
        zy = torch.full((m,), float("nan"), dtype=FP32, device=dev)
        h_arg = descriptor(h_rows, [cfg.block_m, cfg.block_k]) if tma else h_rows
        grid = (min(progs, math.ceil(m / cfg.block_m) * tiles),)
        policy_logits_kernel[grid](
            h_arg, w_arg, y, t_rows, ws, zy, keep_arg, m, v, h, *h_rows.stride(),
            *weight.stride(), keep.stride(0), 0, inv_temp, *cap_args, NUM_PROGS=progs, TMA=tma,
            EVEN_K=h % cfg.block_k == 0, KEEP_TMA=keep_tma, **flags,
        )  # fmt: skip
        out = combine_extras(Partials(ws, zy), y, head.ignore_index, entropy=True)
        log_probs[start:stop] = out.log_probs
        entropy[start:stop] = out.entropy
        if grad_h is None and grad_w is None:
            continue
        terms = token_grads(call, start, stop, out.log_probs, out.entropy)
        g_lp, g_ent = terms.grad_log_probs, terms.grad_entropy
        scale = 1.0
        if hidden.dtype == torch.float16:  # dz formed in fp16's range (fusedhead.fp16_range)
            k = temp[start:stop].reciprocal() if temp is not None else g_lp.new_full((1,), inv_temp)
            scale = chunk_scale(hidden.dtype, g_lp, g_ent, out.entropy, k)
            g_lp, g_ent = g_lp * scale, g_ent * scale
        a = torch.addcmul(g_lp, g_ent, out.entropy).neg_()
        b = g_ent.neg()
        dz_label = label_logit_grad(out.log_probs, out.entropy, g_lp, g_ent)
        dz = keep if keep.dtype == hidden.dtype else keep.view(hidden.dtype)[:, :v]
        block_r, warps, stages = DZ_CONFIG
        policy_dz_kernel[(math.ceil(m / block_r),)](
            keep, dz, ws, y, t_rows, out.row_max, out.log_s, a, b, dz_label, m, v, keep.stride(0),
            dz.stride(0), 0,
            head.ignore_index, inv_temp, *cap_args, BLOCK_R=block_r, BLOCK_N=cfg.block_n,
            PER_TOKEN_T=temp is not None, HAS_SOFTCAP=softcap is not None, STAGES=stages,
            num_warps=warps,
        )  # fmt: skip
        if grad_h is not None:
            hidden_grad_rows(dz, weight, grad_h[start:stop], scale)
        if grad_w is not None:
            grad_w.add(dz, h_rows, alpha=1.0 / scale, only=start == 0 and stop == n)
    del buf, keep, dz, keep_arg  # the kept buffer goes before the fp32 sum is rounded
    return PolicyLossResult(
        log_probs,
        entropy,
        grad_hidden=grad_h,
        grad_weight=None if grad_w is None else grad_w.result(),
    )
