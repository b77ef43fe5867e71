"""A direct call of the triton backend, the float64 reference it is measured against, and bounds
(the inputs and comparisons shared with the other backends live in tests/head_cases.py)."""

from __future__ import annotations

from typing import Any

import torch
from head_cases import IGNORE, Case, Result, case_loss, make_case, rel_err

from fusedhead.reference import reference_fused_head
from fusedhead_triton import TritonBackend, TritonOptions

__all__ = ["IGNORE", "Case", "Result", "make_case", "rel_err"]  # re-exported for the tests

#: Small tiles so that tiny shapes still span several row and vocabulary tiles (ragged ones too).
SMALL_TILES: dict[str, Any] = {"block_m": 32, "block_n": 64, "block_k": 32}
#: Relative-error bounds against float64 on the same input values: (outputs, gradients).
#: fp32: the issue's 1e-5 (exact fp32 dots, fp32 statistics). fp16: outputs are computed in fp32
#: from fp16 values (so near fp32); gradients pass through dz stored in fp16 (2^-11 roundoff).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 2e-3)}


def run_triton(
    case: Case,
    dtype: torch.dtype,
    *,
    temperature: float | torch.Tensor = 0.7,
    softcap: float | None = None,
    entropy: bool = True,
    grad_hidden: bool = True,
    grad_weight: bool = True,
    device: str = "cpu",
    options: dict[str, Any] | None = None,
    labels: torch.Tensor | None = None,
) -> Result:
    """One forward + backward through ``TritonBackend.forward`` (no core in between)."""
    h = case.hidden.to(device=device, dtype=dtype).requires_grad_(grad_hidden)
    w = case.weight.to(device=device, dtype=dtype).requires_grad_(grad_weight)
    lab = (case.labels if labels is None else labels).to(device)
    be = TritonBackend(TritonOptions(**(options or {})))
    lp, ent = be.forward(
        h, w, lab, temperature=temperature, ignore_index=IGNORE, return_entropy=entropy,
        process_group=None, vocab_start=0, vocab_size=w.shape[0], reduce_hidden_grad=True,
        softcap=softcap,
    )  # fmt: skip
    dh = dw = None
    if grad_hidden or grad_weight:
        case_loss(lp, ent, case).backward()
        dh, dw = h.grad, w.grad
    return Result(lp.detach(), None if ent is None else ent.detach(), dh, dw)


def run_reference(
    case: Case,
    dtype: torch.dtype,
    *,
    temperature: float | torch.Tensor = 0.7,
    softcap: float | None = None,
    entropy: bool = True,
    labels: torch.Tensor | None = None,
) -> Result:
    """The float64 full-logits reference on the values the backend saw (rounded to ``dtype``)."""
    h = case.hidden.to(dtype).double().requires_grad_()
    w = case.weight.to(dtype).double().requires_grad_()
    lab = case.labels if labels is None else labels
    t = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    lp, ent = reference_fused_head(
        h, w, lab, temperature=t, ignore_index=IGNORE, return_entropy=entropy, softcap=softcap,
        compute_dtype=torch.float64,
    )  # fmt: skip
    case_loss(lp, ent, case).backward()
    return Result(lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad)


def assert_close(got: Result, want: Result, dtype: torch.dtype, what: str = "") -> None:
    """Every output and gradient within the dtype's relative-error bound."""
    out_tol, grad_tol = TOLERANCE[dtype]
    assert got.log_probs.dtype == torch.float32
    assert rel_err(got.log_probs, want.log_probs) <= out_tol, what
    if want.entropy is not None:
        assert got.entropy is not None and got.entropy.dtype == torch.float32
        assert rel_err(got.entropy, want.entropy) <= out_tol, what
    if got.d_hidden is not None:
        assert got.d_hidden.dtype == dtype
        assert rel_err(got.d_hidden, want.d_hidden) <= grad_tol, what
    if got.d_weight is not None:
        assert got.d_weight.dtype == dtype
        assert rel_err(got.d_weight, want.d_weight) <= grad_tol, what
