"""A double backward is refused with an error naming ``create_graph`` on every backend, every
output and the KL, however the gradients are asked for: ``backward()`` of a total holding a
gradient penalty, ``torch.autograd.grad`` of chosen inputs (hidden, or the weight's second-order
gradient), and the first-order gradient under ``create_graph=True`` is the plain one.

Before: the torch backend hung its refusal on detached copies of the gradients, so
``autograd.grad(lp.sum() + penalty, [hidden])`` silently dropped the penalty's term and
``autograd.grad(g.sum(), [weight])`` said the weight "appears to not have been used in the graph";
the liger adapter returned Liger's precomputed gradients, so every way lost the term silently.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl

N, H, V = 6, 8, 40
OUTPUTS = {
    "log_probs": ({}, "log_probs"),
    "entropy": ({}, "entropy"),
    "lse": ({"return_lse": True}, "lse"),
    "sum_p2": ({"return_sum_p2": True}, "sum_p2"),
    "topk": ({"top_k": 3}, "topk_log_probs"),
    "gather": ({"gather_ids": torch.arange(2 * N).reshape(N, 2)}, "gathered"),
}
BACKENDS = {
    "torch": ("torch", None, [*OUTPUTS, "kl"]),
    "torch-tiled": (
        "torch",
        {"block_vocab": 16, "chunk_rows": 2, "skip_ignored_rows": False},
        [*OUTPUTS, "kl"],
    ),
    "triton": ("triton", {"block_m": 16, "block_n": 16, "block_k": 16}, [*OUTPUTS, "kl"]),
    "liger": ("liger", {"implementation": "fallback"}, ["log_probs", "entropy"]),
}
CASES = [
    pytest.param(backend, options, output, id=f"{name}-{output}")
    for name, (backend, options, outputs) in BACKENDS.items()
    for output in outputs
]
WAYS = ["grad-hidden-twice", "grad-weight-twice", "grad-of-total-with-penalty", "backward"]


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def _output(backend, options, output, h, w, labels) -> torch.Tensor:
    if backend == "liger":
        pytest.importorskip("liger_kernel")
    if output == "kl":
        g = torch.Generator().manual_seed(1)
        t_hidden, t_weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 3
        return fused_kl(h, w, t_hidden, t_weight, labels, backend=backend, options=options)
    kwargs, field = OUTPUTS[output]
    out = fused_head(h, w, labels, backend=backend, options=options, **kwargs)
    t: torch.Tensor = getattr(out, field)
    return t


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("backend", "options", "output"), CASES)
def test_a_second_order_gradient_is_refused_naming_create_graph(backend, options, output, way):
    h, w, labels = _inputs()
    t = _output(backend, options, output, h, w, labels)
    with pytest.raises(RuntimeError, match="create_graph") as info:
        if way == "grad-hidden-twice":
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            torch.autograd.grad(g.pow(2).sum(), [h])
        elif way == "grad-weight-twice":
            (g,) = torch.autograd.grad(t.sum(), [w], create_graph=True)
            torch.autograd.grad(g.pow(2).sum(), [w])
        elif way == "grad-of-total-with-penalty":
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            torch.autograd.grad(t.sum() + g.pow(2).sum(), [h])
        else:
            (g,) = torch.autograd.grad(t.pow(2).sum(), [h], create_graph=True)
            (t.sum() + g.pow(2).sum()).backward()
    assert "not differentiable" in str(info.value)


@pytest.mark.parametrize(("backend", "options", "output"), CASES)
def test_the_first_order_gradient_under_create_graph_is_the_plain_one(backend, options, output):
    h, w, labels = _inputs()
    t = _output(backend, options, output, h, w, labels)
    plain = torch.autograd.grad(t.pow(2).sum(), [h, w], retain_graph=True)
    attached = torch.autograd.grad(t.pow(2).sum(), [h, w], create_graph=True)
    for a, b in zip(attached, plain, strict=True):
        assert a.requires_grad  # attached: a penalty through it is refused, never dropped
        assert torch.equal(a.detach(), b)
