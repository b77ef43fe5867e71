"""How close is close enough: docs/design.md's two error measures and the kit's tolerance table.

Errors are measured against a float64 reference computed from the same input values:
relative error ``||a - b|| / ||b||`` over the whole tensor, and max abs error ``max |a - b|``,
which catches one bad row that the norm hides.

Every bound is a multiple of the effective unit roundoff of the precision ``p`` a quantity is
held in::

    u_eff(p) = u(p) + (sqrt(H) + sqrt(V)) * u(fp32)

``u(p)`` is the unit roundoff (fp32 2^-24 = 6.0e-8, fp16 2^-11 = 4.9e-4, bf16 2^-8 = 3.9e-3),
the error of rounding to ``p``; the second term is the typical error of fp32 accumulation over
the H products of a logit and the V terms of the softmax sum. ``zmax`` is the largest |logit|
of the case's scored rows (after softcap and temperature). The precisions come from the
backend's declared capabilities, read as "never coarser than the inputs": the logits precision
``L`` is the finer of ``logits_precision`` and the input dtype (a backend that declares bf16
logits because its GEMM writes the input dtype is held to fp32 on fp32 inputs), and likewise
for ``entropy_precision``.

    quantity        precision p                      bound
    log_probs       L                                RMS err <= 2 s, max abs err <= 4 s,
    entropy         coarser of L and entropy's       with s = u_eff(p) (1 + zmax + ln V); rel = RMS err / RMS(ref)
    grad hidden, W  coarser of input dtype and L     |err| <= t M + u(p) max(M) elementwise, rel <= that / ||ref||,
                                                     with t = 4 u_eff(p) + expm1(2 u_eff(L) (1 + zmax))

Why: a quantity of size |x| held in ``p`` is off by about ``u |x|``. log p_y = z_y - lse and
H = lse - sum p z are each a difference of two terms no larger than ``zmax + ln V`` (the
log-sum-exp is at most ``zmax + ln V``), so a row's error is at most about ``2 u (zmax + ln V)``:
the RMS bound, and twice it the max abs bound (this also covers a result rounded to ``p`` on
output, e.g. an entropy of about ``ln V`` returned through bf16). The errors scale with the
logits, not with log p or H themselves, hence the relative bound is the RMS bound over the
reference's RMS. A gradient is the GEMM ``(dz / T) @ W`` (or ``.T @ h``); ``M`` is that GEMM with every term
made positive, ``|dz| @ |W|`` with ``|dz| = |g_lp| (onehot + p) + |g_H| p (1 + |log p| + H)``,
the size rounding errors are relative to (the usual GEMM error bound, which stays meaningful
where terms cancel). ``dz`` is rounded to the input dtype for the GEMM and the result rounded on
output (``4 u``), and ``p`` itself is off by a factor up to ``exp(2 u zmax)`` from the logits.
Measured on correct implementations that round the logits to each precision and do the rest in
fp32, and on the torch, triton (interpreter) and liger (fallback) backends, the worst errors on
the kit's inputs are about 3x to 30x below these bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedhead.testing.outcome import PropertyFailure

#: Unit roundoff of each precision a backend may declare.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}


def coarser(*precisions: str) -> str:
    """The least precise of the given precisions."""
    return max(precisions, key=UNIT_ROUNDOFF.__getitem__)


def finer(*precisions: str) -> str:
    """The most precise of the given precisions."""
    return min(precisions, key=UNIT_ROUNDOFF.__getitem__)


def u_eff(precision: str, h: int, v: int) -> float:
    """Effective unit roundoff: rounding to ``precision`` plus fp32 accumulation over H and V."""
    return UNIT_ROUNDOFF[precision] + (math.sqrt(h) + math.sqrt(v)) * UNIT_ROUNDOFF["fp32"]


@dataclass(frozen=True)
class Bound:
    """Error bounds for one quantity, in two forms.

    Forward outputs (``magnitude`` not given): ``scale`` is s = u_eff (1 + zmax); RMS error
    <= 2 s (so rel <= 2 s / RMS(ref)) and max abs error <= 4 s.
    Gradients: ``scale`` is t; each element may be off by t * M + floor * max(M), where M is the
    element's magnitude (the same GEMM with every term made positive), and rel <= that allowance's
    norm over the reference's norm.
    """

    scale: float
    floor: float = 0.0

    def limits(
        self,
        ref: torch.Tensor,
        magnitude: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ) -> tuple[float, torch.Tensor]:
        """(relative error bound, elementwise max abs error bound) against the reference ``ref``;
        ``extra``: an absolute allowance per element added to a gradient's (an error its
        upstream carries in, such as the policy loss's derivative formed from fp32 statistics)."""
        ref = ref.detach().double()
        if magnitude is None:
            rms = float(ref.pow(2).mean().sqrt()) if ref.numel() else 0.0
            rel = 2 * self.scale / rms if rms > 0 else math.inf
            return rel, torch.full_like(ref, 4 * self.scale)
        m = magnitude.detach().double()
        allowed = self.scale * m + self.floor * (float(m.max()) if m.numel() else 0.0)
        if extra is not None:
            allowed = allowed + extra.detach().double()
        bnorm = float(ref.norm())
        return (float(allowed.norm()) / bnorm if bnorm > 0 else math.inf), allowed


@dataclass(frozen=True)
class Tolerances:
    """The bounds for one case, from the backend's declared precisions and the input dtype."""

    log_probs: Bound
    entropy: Bound
    grad: Bound

    @classmethod
    def for_case(
        cls,
        *,
        dtype: str,
        logits_precision: str,
        entropy_precision: str,
        h: int,
        v: int,
        zmax: float,
    ) -> Tolerances:
        """The table above, for inputs of ``dtype`` with H, V and the case's largest |logit|."""
        logits = finer(logits_precision, dtype)
        entropy = coarser(logits, finer(entropy_precision, dtype))
        ul = u_eff(logits, h, v)
        ue = u_eff(entropy, h, v)
        grad = coarser(dtype, logits)
        ug = u_eff(grad, h, v)
        return cls(
            log_probs=Bound(ul * (1 + zmax + math.log(v))),
            entropy=Bound(ue * (1 + zmax + math.log(v))),
            grad=Bound(4 * ug + math.expm1(2 * ul * (1 + zmax)), floor=UNIT_ROUNDOFF[grad]),
        )


def errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative error ``||a - b|| / ||b||``, max abs error ``max |a - b|``) of ``a`` against ``b``."""
    diff = (a.detach().double() - b.detach().double()).reshape(-1)
    if diff.numel() == 0:
        return 0.0, 0.0
    bnorm = float(b.detach().double().norm())
    dnorm = float(diff.norm())
    rel = 0.0 if dnorm == 0 else (dnorm / bnorm if bnorm > 0 else math.inf)
    return rel, float(diff.abs().max())


def _row(shape: torch.Size, flat: int) -> str:
    if len(shape) <= 1:
        return f"row {flat}"
    return f"row {flat // math.prod(shape[1:])}"


def assert_close(
    what: str,
    a: torch.Tensor | None,
    b: torch.Tensor,
    bound: Bound,
    magnitude: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
) -> None:
    """Raise ``PropertyFailure`` naming ``what`` unless ``a`` is within ``bound`` of ``b``."""
    if a is None:
        raise PropertyFailure(f"{what} is missing (None) where a tensor was expected")
    if tuple(a.shape) != tuple(b.shape):
        raise PropertyFailure(f"{what} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
    if b.numel() == 0:
        return
    bad = ~torch.isfinite(a.detach()) & torch.isfinite(b)
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        raise PropertyFailure(
            f"{what} is not finite at {_row(a.shape, flat)} ({int(bad.sum())} element(s)) "
            "where the reference is finite"
        )
    rel, max_abs = errors(a, b)
    rel_bound, allowed = bound.limits(b, magnitude, extra)
    excess = (a.detach().double() - b.detach().double()).abs() - allowed
    if bool((excess > 0).any()):
        flat = int(excess.reshape(-1).argmax())
        got, want = float(a.detach().reshape(-1)[flat]), float(b.detach().reshape(-1)[flat])
        raise PropertyFailure(
            f"{what} abs err {abs(got - want):.3g} at {_row(a.shape, flat)} (got {got:.6g}, "
            f"expected {want:.6g}) > bound {float(allowed.reshape(-1)[flat]):.3g}"
            f" (max abs err {max_abs:.3g}, rel err {rel:.3g})"
        )
    if rel > rel_bound:
        raise PropertyFailure(
            f"{what} rel err {rel:.3g} > bound {rel_bound:.3g} (max abs err {max_abs:.3g})"
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its width (integers as they are)."""
    if not t.is_floating_point():
        return t
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same values bit for bit (NaN included): an input a backend only
    reads is left so; a comparison through ``nan_to_num`` took +Inf written as fp32's max for
    unchanged."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def changed_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shaped tensors differ bit for bit (-0.0 against +0.0, or
    another NaN's payload, count)."""
    return int((_bits(a) != _bits(b)).sum())
