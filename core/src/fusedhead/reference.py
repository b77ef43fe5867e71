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
    _check(hidden, weight, labels, temperature, softcap)
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


def _check(
    hidden: object, weight: object, labels: object, temperature: object, softcap: object
) -> None:
    """The arguments' shapes and scalars, named (any float dtype is taken: this is the yardstick)."""
    from fusedhead.validation import _positive_float, _tensor

    h, w, y = _tensor("hidden", hidden), _tensor("weight", weight), _tensor("labels", labels)
    if w.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got shape {tuple(w.shape)}")
    if h.dim() == 0 or h.shape[-1] != w.shape[1]:
        raise ValueError(
            f"hidden must have shape [..., H] with weight's H={w.shape[1]}, got shape {tuple(h.shape)}"
        )
    if tuple(y.shape) != tuple(h.shape[:-1]):
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(h.shape[:-1])}, got {tuple(y.shape)}"
        )
    if y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
        raise TypeError(f"labels must be an integer tensor, got dtype {y.dtype}")
    if not isinstance(temperature, torch.Tensor):
        _positive_float("temperature", temperature)
    if softcap is not None:
        _positive_float("softcap", softcap)
