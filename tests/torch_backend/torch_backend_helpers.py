"""A direct call of the torch backend, the float64 reference it is measured against, and bounds
(the inputs and comparisons shared with the other backends live in tests/head_cases.py)."""

from __future__ import annotations

from typing import Any

import torch
from head_cases import IGNORE, Case, Result, case_loss, make_case, rel_err

from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head
from fusedhead_torch import TorchBackend, TorchOptions

__all__ = ["IGNORE", "Case", "Result", "make_case", "rel_err"]  # re-exported for the tests

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Relative-error bounds against float64 on the same input values: outputs, gradients.
#: fp32: the issue's 1e-5. fp16/bf16: a few unit roundoffs (2^-11, 2^-8) of the logits/gradients.
TOLERANCE = {"fp32": (1e-5, 1e-5), "fp16": (1e-3, 4e-3), "bf16": (8e-3, 3e-2)}


def run_backend(
    case: Case,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    options: TorchOptions | None = None,
    temperature: float | torch.Tensor = 0.7,
    return_entropy: bool = True,
    softcap: float | None = None,
    grad_hidden: bool = True,
    grad_weight: bool = True,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    **parallel: Any,
) -> Result:
    """Forward and (when anything requires grad) backward of ``TorchBackend`` called directly."""
    h = (case.hidden if hidden is None else hidden).to(device=device, dtype=dtype)
    w = (case.weight if weight is None else weight).to(device=device, dtype=dtype)
    h.requires_grad_(grad_hidden)
    w.requires_grad_(grad_weight)
    kwargs: dict[str, Any] = {
        "process_group": None,
        "vocab_start": 0,
        "vocab_size": w.shape[0],
        "reduce_hidden_grad": True,
    }
    kwargs.update(parallel)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=device, dtype=torch.float32)
    lp, ent = call_backend(
        TorchBackend(options or TorchOptions()),
        h,
        w,
        case.labels.to(device),
        temperature=temperature,
        ignore_index=IGNORE,
        return_entropy=return_entropy,
        softcap=softcap,
        **kwargs,
    )
    if grad_hidden or grad_weight:
        case_loss(lp, ent, case).backward()
    return Result(lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad)


def run_reference(
    case: Case,
    *,
    dtype: torch.dtype = torch.float32,
    temperature: float | torch.Tensor = 0.7,
    return_entropy: bool = True,
    softcap: float | None = None,
    weight_scale: float = 1.0,
    labels: torch.Tensor | None = None,
) -> Result:
    """The float64 full-logits reference on the values ``case`` takes in ``dtype``."""
    h = case.hidden.to(dtype).double().requires_grad_()
    w = case.weight.to(dtype).double().requires_grad_()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.float().double()
    lp, ent = reference_fused_head(
        h,
        w * weight_scale,
        case.labels if labels is None else labels,
        temperature=temperature,
        ignore_index=IGNORE,
        return_entropy=return_entropy,
        softcap=softcap,
        compute_dtype=torch.float64,
    )
    case_loss(lp, ent, case).backward()
    return Result(lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad)


def assert_close(got: Result, want: Result, dtype_name: str, what: str = "") -> None:
    """Outputs and gradients of ``got`` within the dtype's bounds of ``want``."""
    out_tol, grad_tol = TOLERANCE[dtype_name]
    assert got.log_probs.dtype == torch.float32
    pairs = [("log_probs", got.log_probs, want.log_probs, out_tol)]
    if want.entropy is not None:
        assert got.entropy is not None and got.entropy.dtype == torch.float32
        pairs.append(("entropy", got.entropy, want.entropy, out_tol))
    else:
        assert got.entropy is None
    if want.d_hidden is not None and got.d_hidden is not None:
        pairs.append(("d_hidden", got.d_hidden, want.d_hidden, grad_tol))
    if want.d_weight is not None and got.d_weight is not None:
        pairs.append(("d_weight", got.d_weight, want.d_weight, grad_tol))
    for name, a, b, tol in pairs:
        err = rel_err(a, b)
        assert err <= tol, f"{what} {name}: relative error {err:.3g} > {tol:g}"
