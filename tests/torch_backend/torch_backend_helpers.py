"""Inputs, a direct call of the torch backend, and the float64 reference it is measured against."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.reference import reference_fused_head
from fusedhead_torch import TorchBackend, TorchOptions

IGNORE = -100
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Relative-error bounds against float64 on the same input values: outputs, gradients.
#: fp32: the issue's 1e-5. fp16/bf16: a few unit roundoffs (2^-11, 2^-8) of the logits/gradients.
TOLERANCE = {"fp32": (1e-5, 1e-5), "fp16": (1e-3, 4e-3), "bf16": (8e-3, 3e-2)}


@dataclass
class Case:
    """Inputs of one call, kept in float64 so every dtype sees the same values."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    g_lp: torch.Tensor
    g_ent: torch.Tensor


@dataclass
class Result:
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    d_hidden: torch.Tensor | None
    d_weight: torch.Tensor | None


def make_case(
    n: int, h: int, v: int, *, seed: int = 0, peak: float = 1.0, ignore_every: int = 7
) -> Case:
    """DESIGN.md's inputs: h ~ N(0, 1), W ~ N(0, (peak / sqrt(H))^2), some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (peak / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return Case(hidden, weight, labels, g_lp, g_ent)


def _loss(lp: torch.Tensor, ent: torch.Tensor | None, case: Case) -> torch.Tensor:
    # nansum: a NaN row (out-of-range label) is the caller's to skip; outputs are checked apart.
    loss = (lp.double() * case.g_lp.to(lp.device)).nansum()
    if ent is not None:
        loss = loss + (ent.double() * case.g_ent.to(ent.device)).sum()
    return loss


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
    lp, ent = TorchBackend(options or TorchOptions()).forward(
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
        _loss(lp, ent, case).backward()
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
    _loss(lp, ent, case).backward()
    return Result(lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """DESIGN.md's relative error ``||a - b|| / ||b||``."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


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
