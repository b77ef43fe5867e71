"""Errors against a reference computed from the same input values in higher precision.

The reference is ``fusedhead.reference`` run over row blocks (rows are independent, the weight
gradient is summed over blocks), so it fits in memory for the GPU shapes too: float64 on the CPU,
fp32 (TF32 off) on a GPU. Errors per output: relative ``||a - b|| / ||b||`` over the whole tensor
and max abs ``max |a - b|``, which catches a single bad row that the norm hides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.bench.cases import IGNORE_INDEX, Case, Inputs
from fusedhead.bench.metrics import error, reference_dtype
from fusedhead.reference import reference_fused_head

OUTPUTS = ("log_probs", "entropy", "grad_hidden", "grad_weight")


@dataclass
class Reference:
    """Reference outputs and gradients (of log-probs and entropy weighted by the upstream grads)."""

    dtype: torch.dtype
    log_probs: torch.Tensor
    entropy: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    #: Gradients of the log-prob term alone, for implementations without entropy (or None).
    grad_hidden_lp: torch.Tensor | None = None
    grad_weight_lp: torch.Tensor | None = None

    def grads(self, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if with_entropy:
            return self.grad_hidden, self.grad_weight
        if self.grad_hidden_lp is None or self.grad_weight_lp is None:
            raise ValueError("reference computed without the log-prob-only gradients")
        return self.grad_hidden_lp, self.grad_weight_lp


def _block_rows(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    budget = (1 << 30) if device.type == "cuda" else (128 << 20)
    per_row = vocab * torch.empty((), dtype=dtype).element_size()
    return max(1, budget // per_row)


def compute_reference(
    case: Case, inputs: Inputs, *, dtype: torch.dtype | None = None, lp_only_grads: bool = False
) -> Reference:
    """The reference of one case in ``dtype`` (default per device), by row blocks."""
    device = inputs.hidden.device
    dtype = dtype or reference_dtype(device)
    n = case.n
    w = inputs.weight.detach().to(dtype).requires_grad_(True)
    lp_out = torch.empty(n, dtype=dtype, device=device)
    ent_out = torch.empty(n, dtype=dtype, device=device)
    dh = torch.empty(n, case.hidden, dtype=dtype, device=device)
    dw = torch.zeros_like(w)
    dh_lp = torch.empty_like(dh) if lp_only_grads else None
    dw_lp = torch.zeros_like(w) if lp_only_grads else None
    rows = _block_rows(case.vocab, dtype, device)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        h = inputs.hidden[start:end].detach().to(dtype).requires_grad_(True)
        lp, ent = reference_fused_head(
            h,
            w,
            inputs.labels[start:end],
            temperature=case.temperature,
            ignore_index=IGNORE_INDEX,
            compute_dtype=dtype,
        )
        assert ent is not None
        g_lp = inputs.grad_log_probs[start:end].to(dtype)
        g_ent = inputs.grad_entropy[start:end].to(dtype)
        lp_out[start:end] = lp.detach()
        ent_out[start:end] = ent.detach()
        if lp_only_grads:
            assert dh_lp is not None and dw_lp is not None
            gh1, gw1 = torch.autograd.grad([lp], [h, w], [g_lp], retain_graph=True)
            gh2, gw2 = torch.autograd.grad([ent], [h, w], [g_ent])
            dh_lp[start:end] = gh1
            dw_lp += gw1
            dh[start:end] = gh1 + gh2
            dw += gw1 + gw2
        else:
            gh, gw = torch.autograd.grad([lp, ent], [h, w], [g_lp, g_ent])
            dh[start:end] = gh
            dw += gw
        del lp, ent, h
    return Reference(dtype, lp_out, ent_out, dh, dw, dh_lp, dw_lp)


def compare(
    ref: Reference,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> dict[str, Any]:
    """Errors of every output an implementation gave; entropy None means "not computed"."""
    dh_ref, dw_ref = ref.grads(entropy is not None)
    out: dict[str, Any] = {"log_probs": error(log_probs, ref.log_probs)}
    out["entropy"] = error(entropy, ref.entropy) if entropy is not None else None
    out["grad_hidden"] = error(grad_hidden, dh_ref) if grad_hidden is not None else None
    out["grad_weight"] = error(grad_weight, dw_ref) if grad_weight is not None else None
    return out
