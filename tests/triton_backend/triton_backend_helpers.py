"""A direct call of the triton backend, the float64 reference it is measured against, and bounds
(the inputs and comparisons shared with the other backends live in tests/head_cases.py)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from head_cases import IGNORE, Case, Result, case_loss, make_case, rel_err

from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head
from fusedhead_triton import TritonBackend, TritonOptions

__all__ = ["IGNORE", "Case", "Result", "make_case", "rel_err"]  # re-exported for the tests

#: Small tiles so that tiny shapes still span several row and vocabulary tiles (ragged ones too).
SMALL_TILES: dict[str, Any] = {"block_m": 32, "block_n": 64, "block_k": 32}
#: Relative-error bounds against float64 on the same input values: (outputs, gradients).
#: fp32: the issue's 1e-5 (exact fp32 dots, fp32 statistics). fp16: outputs are computed in fp32
#: from fp16 values (so near fp32); gradients pass through dz stored in fp16 (2^-11 roundoff).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 2e-3)}

#: For the tests that read torch's peak memory: without the caching allocator (compute-sanitizer
#: runs set PYTORCH_NO_CUDA_MEMORY_CACHING=1: scripts/gpu/sanitize.sh) the peak reads 0.
reads_peak_memory = pytest.mark.skipif(
    os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"),
    reason="PYTORCH_NO_CUDA_MEMORY_CACHING is set: torch.cuda.max_memory_allocated() reads 0",
)


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
    lp, ent = call_backend(be,
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


#: Relative rounding of the hidden-gradient running sum at each store between vocabulary blocks:
#: exact fp32 (fp16's fp32 buffer, dh_sum "fp32", cuBLAS's accumulator), fp24's 16-bit
#: significand, and the bf16 pair (bf16 hi + bf16 remainder: at least 16 significant bits).
SUM_UNIT = {"fp32": 2.0**-24, "fp24": 2.0**-16, "bf16 pair": 2.0**-16}


def sum_slack(want: torch.Tensor, adds: int, unit: float) -> float:
    """How far ``adds`` roundings of a running sum to ``unit`` can move a result, its partial
    sums taken as large as ``want``'s largest value: for values that cancel to far less."""
    return adds * unit * float(want.detach().abs().max())


def assert_within_one_ulp(
    got: torch.Tensor, want: torch.Tensor, *, slack: float = 0.0, what: str = ""
) -> None:
    """Every element of ``got`` at most one ulp of the dtype away from ``want`` (``want``'s
    neighbours by ``torch.nextafter``), give or take ``slack`` (absolute)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    a, b = got.detach().cpu(), want.detach().cpu()
    assert bool(torch.isfinite(b).all()), what
    inf = torch.full_like(b, math.inf)
    lo = torch.nextafter(b, -inf).double() - slack
    hi = torch.nextafter(b, inf).double() + slack
    x = a.double()
    bad = (x < lo) | (x > hi) | ~torch.isfinite(x)
    assert not bool(bad.any()), (
        f"{what} {int(bad.sum())} of {b.numel()} values more than one ulp (+ {slack:.3g}) apart, "
        f"e.g. {a[bad][:4].tolist()} against {b[bad][:4].tolist()}"
    )
