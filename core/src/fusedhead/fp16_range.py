"""fp16's narrow range in a three-GEMM policy step: each chunk's ``dz`` at its own scale.

A policy-loss backend forms the gradients in the forward, before any upstream (GradScaler) scale
exists. fp16 reaches down to 6e-8 only: a token-mean over a global count of G tokens has token
weights ``1/G``, and at scale 1 most of a chunk's ``[rows, V]`` ``dz`` flushes to zero (G = 2**18:
8 % of the hidden gradient 0, 6.6e-2 from float64). A fixed scale cannot serve every call either:
one token with a huge derivative (TRL's unclamped k3 far from the reference) overflows it. So each
chunk's ``dz`` is formed at a power of two ``s`` read from that chunk's own coefficients, where its
largest value lands in (2**13, 2**14], and both gradients are summed in fp32 at their true scale
(``dX`` rows divided by ``s``; ``dW`` by the GEMM's ``alpha = 1/s``). The core rounds them to fp16
once the upstream scale is applied. Costs one host read per chunk, for fp16 only. bf16 and fp32
have fp32's exponent range: scale 1, nothing read.
"""

from __future__ import annotations

import math

import torch

from fusedhead.grad_sum import FP32, addmm_out_dtype_works, fp32_reductions

#: The top of a chunk's ``dz`` bound at its scale: a power of two well under fp16's 65504.
TOP = 2.0**14


def chunk_scale(
    dtype: torch.dtype, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor,
    entropy: torch.Tensor, inv_temp: torch.Tensor,
) -> float:  # fmt: skip
    """The power of two ``s`` to form a chunk's ``dz`` at (1.0 unless ``dtype`` is fp16).

    Per row ``|dz_j| = k |g_lp (onehot_j - p_j) - g_H p_j (log p_j + H)| <= k (|g_lp| +
    |g_H| (1/e + H))`` (a softcap's factor is at most 1); ``s`` puts the chunk's largest bound in
    (TOP/2, TOP]. One host read.
    """
    if dtype != torch.float16 or grad_log_probs.numel() == 0:
        return 1.0
    bound = inv_temp * (grad_log_probs.abs() + grad_entropy.abs() * (0.5 + entropy.abs()))
    # an ignored row has zero derivatives, and with check_labels=False any temperature (0, NaN)
    bound = torch.where(grad_log_probs.eq(0) & grad_entropy.eq(0), 0.0, bound)
    top = float(bound.max())
    if not math.isfinite(top) or top <= 0.0:
        return 1.0
    exponent = math.frexp(TOP / top)[1] - 1  # 2**exponent <= TOP / top
    return math.ldexp(1.0, max(-120, min(120, exponent)))


def hidden_grad(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden gradient's buffer: fp32 for fp16 hidden states (summed at true scale), else
    hidden's dtype."""
    dtype = FP32 if hidden.dtype == torch.float16 else hidden.dtype
    return torch.empty(hidden.shape, dtype=dtype, device=hidden.device)


def hidden_grad_rows(
    dz: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, scale: float
) -> None:
    """``out = dz @ weight / scale`` for ``dz`` formed at ``scale``: in ``out``'s dtype directly
    where that is ``dz``'s, else in fp32 (cuBLAS's fp32 output on CUDA, upcast operands elsewhere)."""
    if out.dtype == dz.dtype:
        with fp32_reductions():  # a K of V: cuBLAS would split it, and may add the parts in bf16
            torch.mm(dz, weight, out=out)
        return
    if addmm_out_dtype_works(dz.device, dz.dtype):  # cuBLAS: fp16 operands, fp32 output
        out.copy_(torch.mm(dz, weight, out_dtype=FP32))
    else:
        torch.mm(dz.float(), weight.float(), out=out)
    if scale != 1.0:
        out.mul_(1.0 / scale)
