"""The plain full-logits computation: the yardstick for tests, the conformance kit and bench.

It materialises ``[N, V]`` logits on purpose and differentiates through autograd, so it is
obviously right and obviously memory-hungry. Compute in float64 to measure other backends.
"""

from __future__ import annotations

import torch


def reference_fused_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    softcap: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and entropy of each row from full logits, in ``compute_dtype``.

    ``hidden [..., H]``, ``weight [V, H]``, ``labels [...]``; ``temperature`` a float or a tensor
    broadcastable to ``labels``; ``softcap`` applies ``c * tanh(z / c)`` before the temperature
    division. Out-of-range labels (not ``ignore_index``) give NaN. Outputs have the shape of ``labels`` and dtype ``compute_dtype`` (default: the input
    dtype promoted to at least fp32). Ignored rows give 0 and no gradient.
    """
    dtype = compute_dtype or torch.promote_types(hidden.dtype, torch.float32)
    h = hidden.to(dtype)
    w = weight.to(dtype)
    z = h @ w.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=z.device, dtype=dtype).expand(labels.shape).unsqueeze(-1)
        z = z / t
    else:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    in_range = (labels >= 0) & (labels < z.shape[-1])
    safe = torch.where(valid & in_range, labels, torch.zeros_like(labels)).long()
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=dtype, device=z.device)
    logp = torch.where(valid, logp, zero)
    logp = torch.where(valid & ~in_range, torch.full_like(logp, float("nan")), logp)
    if not return_entropy:
        return logp, None
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ent = torch.where(valid, ent, zero)
    return logp, ent
