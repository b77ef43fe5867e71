"""A negative view (``x.conj().imag`` of a real ``x`` cast to complex, or ``torch._neg_view``)
equals ``x`` but its memory holds ``-x``: torch's own ops resolve the bit, a backend's raw kernel
reads the memory. The triton backend's policy loss read such a weight as ``-W`` (log-probs 2 nats
off, wrong gradients, no error); the core now hands every backend the values themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from policy_backends import POLICY_BACKENDS

import fusedhead

B, S, H, V = 2, 4, 8, 16


def _negative_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, as a view whose memory holds ``-x``, differentiable back to ``x``."""
    view = torch._neg_view(-x)
    assert view.is_neg() and torch.equal(view, x)
    return view


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(B, S, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / 4,
        "labels": torch.randint(0, V, (B, S), generator=g),
        "temperature": 0.5 + torch.rand(B, S, generator=g),
    }


def _policy(backend: str, h: torch.Tensor, w: torch.Tensor, t: Any) -> Any:
    x = _inputs()
    return fusedhead.fused_policy_loss(
        h, w, x["labels"], old_log_probs=None, advantages=torch.ones(B, 1), temperature=t,
        entropy_coef=0.01, backend=backend,
    )  # fmt: skip


def _head(backend: str, h: torch.Tensor, w: torch.Tensor, t: Any) -> Any:
    return fusedhead.fused_head(h, w, _inputs()["labels"], temperature=t, backend=backend)


def _kl(backend: str, h: torch.Tensor, w: torch.Tensor, t: Any) -> Any:
    x = _inputs()
    teacher_h, teacher_w = x["hidden"].flip(0), x["weight"].flip(0)
    return fusedhead.fused_kl(
        h, w, teacher_h, teacher_w, x["labels"], temperature=t, backend=backend
    )


def _scalar(out: Any) -> torch.Tensor:
    if hasattr(out, "loss"):
        return out.loss
    return out.log_probs.sum() + out.entropy.sum() if hasattr(out, "entropy") else out.sum()


@pytest.mark.parametrize(
    "entry", [_policy, _head, _kl], ids=["policy_loss", "fused_head", "fused_kl"]
)
@pytest.mark.parametrize("which", ["weight", "hidden", "temperature"])
@pytest.mark.parametrize("backend", POLICY_BACKENDS)
def test_a_negative_view_gives_what_its_values_give(
    backend: str, which: str, entry: Callable[..., Any]
) -> None:
    x = _inputs()
    plain = {k: x[k].clone().requires_grad_(k != "temperature") for k in ("hidden", "weight")}
    base = {k: x[k].clone().requires_grad_(k != "temperature") for k in ("hidden", "weight")}
    viewed = {k: _negative_view(v) if k == which else v for k, v in base.items()}
    temp = _negative_view(x["temperature"]) if which == "temperature" else x["temperature"]
    want = entry(backend, plain["hidden"], plain["weight"], x["temperature"])
    got = entry(backend, viewed["hidden"], viewed["weight"], temp)
    for name in ("loss", "log_probs", "entropy"):
        if isinstance(getattr(want, name, None), torch.Tensor):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    _scalar(want).backward()
    _scalar(got).backward()
    for k in ("hidden", "weight"):
        torch.testing.assert_close(base[k].grad, plain[k].grad, rtol=0, atol=0)
