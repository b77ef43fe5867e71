"""Run a case through the backend and through the float64 reference, and compare the two."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.reference import reference_fused_head
from fusedhead.testing.inputs import IGNORE_INDEX, Case, upstream
from fusedhead.testing.outcome import PropertyFailure
from fusedhead.testing.target import Target
from fusedhead.testing.tolerances import assert_close

Views = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
BOTH = ("hidden", "weight")
LOSS = ("log_probs", "entropy")


@dataclass(frozen=True)
class Outputs:
    """Forward outputs and the gradients of the leaves (None where not asked for or not computed)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    requires_grad: bool


def _identity(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return h, w, y


def evaluate(
    fn: Callable[..., Any],
    case: Case,
    dtype: torch.dtype,
    *,
    requires: Collection[str] = BOTH,
    loss: Collection[str] = LOSS,
    seed: int = 0,
    views: Views = _identity,
    **kwargs: Any,
) -> Outputs:
    """Forward ``fn`` on copies of the case's leaves in ``dtype``; backward the asked-for outputs.

    The loss is ``sum(g_lp * log_probs) + sum(g_H * entropy)`` with fixed random upstream
    gradients, restricted to the outputs named in ``loss``.
    """
    h = case.hidden.detach().to(dtype).requires_grad_("hidden" in requires)
    w = case.weight.detach().to(dtype).requires_grad_("weight" in requires)
    args = views(h, w, case.labels)
    lp, ent = fn(*args, **kwargs)
    wants_grad = h.requires_grad or w.requires_grad
    if wants_grad and loss:
        g_lp, g_ent = upstream(lp.shape, seed)
        total = torch.zeros((), dtype=torch.float64, device=lp.device)
        if "log_probs" in loss:
            total = total + (lp.double() * g_lp.to(lp.device, torch.float64)).sum()
        if "entropy" in loss and ent is not None:
            total = total + (ent.double() * g_ent.to(ent.device, torch.float64)).sum()
        if total.requires_grad:
            torch.autograd.backward([total])
    return Outputs(
        lp.detach(),
        None if ent is None else ent.detach(),
        h.grad,
        w.grad,
        bool(lp.requires_grad),
    )


def reference(
    h: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = True,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 yardstick, called like the backend (distributed-only arguments ignored)."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float64)
    return reference_fused_head(
        h,
        w,
        y,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        softcap=softcap,
        compute_dtype=torch.float64,
    )


def zmax(
    case: Case,
    *,
    temperature: float | torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    **_: Any,
) -> float:
    """The largest |logit| over the scored rows, after softcap and temperature (float64)."""
    h = case.hidden.reshape(-1, case.hidden.shape[-1]).double()
    y = case.labels.reshape(-1)
    keep = y != ignore_index
    if not bool(keep.any()):
        return 0.0
    z = h[keep] @ case.weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(torch.float64).expand(case.labels.shape).reshape(-1)[keep]
        z = z / t.unsqueeze(-1).to(z.device)
    else:
        z = z / temperature
    return float(z.abs().max())


def gradient_terms(
    case: Case,
    *,
    loss: Collection[str] = LOSS,
    seed: int = 0,
    views: Views = _identity,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = True,
    softcap: float | None = None,
    **_: Any,
) -> torch.Tensor:
    """|dLoss/d(h @ W.T)| with every term made positive, ``[N, V]`` float64 (the rows of the call).

    ``D = (|g_lp| (onehot + p) + |g_H| p (1 + |log p| + H)) * softcap' / T``, zero on ignored rows:
    the size of what a backward sums, against which its rounding errors are measured.
    """
    hs, ws, ys = views(case.hidden.detach().double(), case.weight.detach().double(), case.labels)
    y = ys.reshape(-1).long()
    raw = hs.reshape(-1, ws.shape[1]) @ ws.T
    slope: torch.Tensor | float = 1.0
    if softcap is not None:
        th = torch.tanh(raw / softcap)
        raw, slope = softcap * th, 1 - th * th
    temp: torch.Tensor | float = temperature
    if isinstance(temperature, torch.Tensor):
        temp = temperature.to(raw.device, torch.float64).expand(ys.shape).reshape(-1, 1)
    z = raw / temp
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    ent = -(p * logp).sum(-1, keepdim=True)
    g_lp, g_ent = (
        g.to(raw.device, torch.float64).reshape(-1, 1).abs() for g in upstream(ys.shape, seed)
    )
    valid = (y != ignore_index) & (y >= 0) & (y < z.shape[1])
    onehot = torch.zeros_like(p)
    onehot[valid, y[valid]] = 1.0
    d = torch.zeros_like(p)
    if "log_probs" in loss:
        d = d + g_lp * (onehot + p)
    if "entropy" in loss and return_entropy:
        d = d + g_ent * p * (1 + logp.abs() + ent)
    d = d * slope / temp
    d[y == ignore_index] = 0.0
    return d


def gradient_magnitudes(
    case: Case, *, views: Views = _identity, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D @ |W|, D.T @ |h|)`` mapped back onto the hidden and weight leaves (through ``views``)."""
    d = gradient_terms(case, views=views, **kwargs)
    h_abs = case.hidden.detach().double().abs().requires_grad_(True)
    w_abs = case.weight.detach().double().abs().requires_grad_(True)
    hv, wv, _ = views(h_abs, w_abs, case.labels)
    torch.autograd.backward([(d * (hv.reshape(-1, wv.shape[1]) @ wv.T)).sum()])
    assert h_abs.grad is not None and w_abs.grad is not None
    return h_abs.grad, w_abs.grad


def declared_temperature(
    target: Target, temperature: float | torch.Tensor, label: str
) -> tuple[float | torch.Tensor, str]:
    """``temperature`` within the backend's declared ``min_temperature``, and ``label`` saying so
    where it was raised (the kit never calls a backend below what it declares it computes)."""
    allowed = target.allowed_temperature(temperature)
    if allowed is not temperature and (isinstance(allowed, torch.Tensor) or allowed != temperature):
        label += f" (temperature raised to the declared min_temperature {target.min_temperature:g})"
    return allowed, label


def check_against_reference(
    target: Target,
    case: Case,
    *,
    label: str = "",
    requires: Collection[str] = BOTH,
    loss: Collection[str] = LOSS,
    seed: int = 0,
    views: Views = _identity,
    call_case: Case | None = None,
    **kwargs: Any,
) -> Outputs:
    """Run the backend and the float64 reference on ``case``; raise ``PropertyFailure`` on a mismatch.

    Compares log_probs, entropy (if returned) and the gradients of the leaves that require grad,
    with the tolerances of ``target`` for this case. Returns the backend's outputs.
    ``call_case`` (default ``case``) is what the backend is called on: the same scored rows with
    other ignored rows (``poison_ignored``), which must change nothing the reference gives.
    """
    where = f"{label or case.description}"
    kwargs.setdefault("ignore_index", IGNORE_INDEX)
    kwargs["temperature"], where = declared_temperature(
        target, kwargs.get("temperature", 1.0), where
    )
    try:
        got = evaluate(
            target,
            case if call_case is None else call_case,
            target.dtype,
            requires=requires,
            loss=loss,
            seed=seed,
            views=views,
            **kwargs,
        )
    except PropertyFailure:
        raise
    except Exception as exc:  # a crash is a contract failure, reported with the case
        raise PropertyFailure(f"{where}: the backend raised {type(exc).__name__}: {exc}") from exc
    want = evaluate(
        reference,
        case,
        torch.float64,
        requires=requires,
        loss=loss,
        seed=seed,
        views=views,
        **kwargs,
    )
    _, h, v = case.shape
    tol = target.tolerances(h, v, zmax(case, **kwargs))
    try:
        assert_close("log_probs", got.log_probs, want.log_probs, tol.log_probs)
        if kwargs.get("return_entropy", True):
            assert want.entropy is not None
            assert_close("entropy", got.entropy, want.entropy, tol.entropy)
        elif got.entropy is not None:
            raise PropertyFailure("entropy is not None with return_entropy=False")
        if loss and requires:
            mags = gradient_magnitudes(case, views=views, loss=loss, seed=seed, **kwargs)
            for leaf, g, w, m in (
                ("hidden", got.grad_hidden, want.grad_hidden, mags[0]),
                ("weight", got.grad_weight, want.grad_weight, mags[1]),
            ):
                if leaf not in requires:
                    continue
                if g is None:
                    raise PropertyFailure(f"grad of {leaf} is None although {leaf} requires grad")
                assert w is not None
                assert_close(f"grad {leaf}", g, w, tol.grad, m)
    except PropertyFailure as exc:
        raise PropertyFailure(f"{where}: {exc}") from None
    return got
