"""Token ids sampled during a rollout are often inference tensors (``torch.inference_mode()``):
labels, ``gather_ids`` and per-token temperatures made there are taken as any other. Before, the
backend's backward could not save them (autograd's unnamed RuntimeError), on one rank of a
vocab-parallel call a hang while the others waited; hidden and weight stay refused by name
(tests/core/test_bad_input_layouts.py), since their gradient must reach them."""

from __future__ import annotations

import pytest
import torch

import fusedhead

BACKENDS = ["torch", "triton"]  # triton under TRITON_INTERPRET=1 on the CPU (tests/conftest.py)
N, H, V = 6, 8, 50


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(N, H, generator=g),
        "weight": torch.randn(V, H, generator=g) / 3,
        "labels": torch.randint(0, V, (N,), generator=g),
        "temperature": 0.5 + torch.rand(N, generator=g),
        "gather_ids": torch.randint(0, V, (N, 3), generator=g),
        "teacher": torch.randn(N, H, generator=g),
    }


def _run(backend: str, x: dict[str, torch.Tensor], inference: bool) -> list[torch.Tensor]:
    """Every differentiable entry point's outputs and hidden gradients, with the non-float
    arguments (and the temperatures) made under inference_mode where ``inference``."""
    cast = _inference if inference else (lambda t: t.clone())
    y, temp, ids = cast(x["labels"]), cast(x["temperature"]), cast(x["gather_ids"])
    results = []
    for call in (
        lambda h: fusedhead.fused_head(h, x["weight"], y, backend=backend, temperature=temp)
        .log_probs.sum(),
        lambda h: fusedhead.fused_head(h, x["weight"], y, backend=backend, gather_ids=ids, top_k=2)
        .gathered.sum(),
        lambda h: fusedhead.fused_kl(
            h, x["weight"], x["teacher"], x["weight"], y, backend=backend,
            temperature=temp, teacher_temperature=temp,
        ).sum(),
        lambda h: fusedhead.fused_policy_loss(
            h, x["weight"], y, old_log_probs=None, advantages=torch.ones(N), temperature=temp,
            backend=backend,
        ).loss,
    ):  # fmt: skip
        h = x["hidden"].clone().requires_grad_()
        value = call(h)
        value.backward()
        assert h.grad is not None
        results += [value.detach(), h.grad]
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_and_temperatures_made_under_inference_mode_are_taken(backend: str) -> None:
    x = _inputs()
    want = _run(backend, x, inference=False)
    got = _run(backend, x, inference=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
