"""A backend's policy-loss gradients are fresh memory of their own: the backward scales them in
place and autograd may keep them as ``.grad``. One that overlaps itself or shares memory with an
input or another output is a ``BackendContractError`` naming it, not a torch error at backward or
a corrupted input."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from policy_kit_backends import PolicyRef

import fusedhead
from fusedhead import registry
from fusedhead.errors import BackendContractError
from fusedhead.protocol import PolicyLossCall, PolicyLossResult

Shape = Callable[[PolicyLossCall, PolicyLossResult], PolicyLossResult]

SHAPES: dict[str, tuple[Shape, str]] = {
    "an expanded zero weight gradient": (
        lambda call, r: PolicyLossResult(
            r.log_probs,
            r.entropy,
            grad_hidden=r.grad_hidden,
            grad_weight=torch.zeros((), dtype=call.head.weight.dtype).expand(
                call.head.weight.shape
            ),
        ),
        r"grad_weight must be a fresh tensor, got one whose elements share memory",
    ),
    "the hidden states as their own gradient": (
        lambda call, r: PolicyLossResult(
            r.log_probs, r.entropy, grad_hidden=call.head.hidden, grad_weight=r.grad_weight
        ),
        r"grad_hidden must be a fresh tensor, got one that shares memory with hidden",
    ),
    "a view of the weight": (
        lambda call, r: PolicyLossResult(
            r.log_probs, r.entropy, grad_hidden=r.grad_hidden, grad_weight=call.head.weight[:]
        ),
        r"grad_weight must be a fresh tensor, got one that shares memory with weight",
    ),
}


@pytest.fixture(params=list(SHAPES))
def broken(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """An in-process backend whose result is right but for the memory of one gradient."""
    reshape, words = SHAPES[request.param]

    class Broken(PolicyRef):
        name: ClassVar[str] = "policy-unfresh"

        def policy_loss(self, call: PolicyLossCall) -> PolicyLossResult:
            return reshape(call, super().policy_loss(call))

    registry.register_backend(Broken.name, Broken, replace=True)
    try:
        yield Broken.name, words
    finally:
        registry.unregister_backend(Broken.name)


def test_gradients_that_are_not_fresh_are_refused_by_name(broken: tuple[str, str]) -> None:
    name, words = broken
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g)
    weight = torch.randn(11, 8, generator=g)
    before = (hidden.clone(), weight.clone())
    kw: dict[str, Any] = {"old_log_probs": torch.full((6,), -2.0), "advantages": torch.ones(6)}
    with pytest.raises(BackendContractError, match=words) as info:
        fusedhead.fused_policy_loss(
            hidden.requires_grad_(), weight.requires_grad_(), torch.arange(6), backend=name, **kw
        )
    assert name in str(info.value)
    assert torch.equal(hidden, before[0]) and torch.equal(weight, before[1])


@pytest.mark.parametrize("name", ["torch", PolicyRef.name])
def test_fresh_gradients_pass_and_scale(name: str) -> None:
    """Right results pass the check, and the backward scales them (``loss * 4``)."""
    registry.register_backend(PolicyRef.name, PolicyRef, replace=True)
    try:
        w = torch.randn(11, 8, requires_grad=True)
        out = fusedhead.fused_policy_loss(
            torch.randn(6, 8, requires_grad=True), w, torch.arange(6), backend=name,
            old_log_probs=torch.full((6,), -2.0), advantages=torch.ones(6),
        )  # fmt: skip
        (out.loss * 4).backward()
    finally:
        registry.unregister_backend(PolicyRef.name)
    assert w.grad is not None and bool(torch.isfinite(w.grad).all()) and bool(w.grad.ne(0).any())
