"""A double backward (``create_graph=True``, then a gradient of that gradient) through the torch
backend: the first-order gradient comes back right and attached to the graph, and asking for the
second-order one raises an error that says so, for the head, every extra output and the KL.

Before: the head and its extras raised deep inside the backward (``mul(): functions with out=...
arguments don't support automatic differentiation``), and the KL's gradient came back detached,
so a gradient penalty through it was silently dropped (0 instead of its gradient); the triton
backend's refusal pointed at ``backend='torch'`` for second-order gradients, which it lacks too.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head, fused_kl

N, H, V = 6, 8, 40
#: (call keywords, the output differentiated)
OUTPUTS = {
    "log_probs": ({}, "log_probs"),
    "entropy": ({}, "entropy"),
    "topk": ({"top_k": 3}, "topk_log_probs"),
    "gather": ({"gather_ids": torch.arange(2 * N).reshape(N, 2)}, "gathered"),
    "lse": ({"return_lse": True}, "lse"),
    "sum_p2": ({"return_sum_p2": True}, "sum_p2"),
}
LAYOUTS = [None, {"block_vocab": 16, "chunk_rows": 2, "skip_ignored_rows": False}]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / 3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = -100
    return hidden, weight, labels


def _first_order_reference(out_name, kwargs, hidden, weight, labels, loss):
    """d loss(output) / d hidden from full float64 logits."""
    h = hidden.double().requires_grad_()
    logp = torch.log_softmax(h @ weight.double().T, -1)
    valid = labels != -100
    if out_name == "log_probs":
        t = logp.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    elif out_name == "entropy":
        t = -(logp.exp() * logp).sum(-1)
    elif out_name == "topk_log_probs":
        t = logp.gather(1, torch.topk(logp, kwargs["top_k"], -1).indices)
    elif out_name == "gathered":
        t = logp.gather(1, kwargs["gather_ids"])
    elif out_name == "lse":
        t = torch.logsumexp(h @ weight.double().T, -1)
    else:
        t = (logp.exp() ** 2).sum(-1)
    t = torch.where(valid.reshape(-1, *([1] * (t.dim() - 1))), t, 0)
    (g,) = torch.autograd.grad(loss(t), h)
    return g


@pytest.mark.parametrize("options", LAYOUTS, ids=["default", "tiled"])
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_head_outputs_give_the_first_order_gradient_and_refuse_the_second(output, options):
    kwargs, name = OUTPUTS[output]
    hidden, weight, labels = _inputs()
    h = hidden.clone().requires_grad_()
    out = fused_head(h, weight, labels, options=options, **kwargs)
    (g,) = torch.autograd.grad(getattr(out, name).pow(2).sum(), h, create_graph=True)
    want = _first_order_reference(name, kwargs, hidden, weight, labels, lambda t: t.pow(2).sum())
    assert (g.double() - want).abs().max() < 1e-5
    assert g.requires_grad  # attached: a penalty through it is never dropped silently
    with pytest.raises(RuntimeError, match="double backward") as info:
        g.pow(2).sum().backward()
    assert "create_graph=True" in str(info.value) and "torch backend" in str(info.value)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_kl_gives_the_first_order_gradient_and_refuses_the_second(direction):
    hidden, weight, labels = _inputs(1)
    t_hidden, t_weight, _ = _inputs(2)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    kl = fused_kl(h, w, t_hidden, t_weight, labels, direction=direction)
    gh, gw = torch.autograd.grad(kl.sum(), (h, w), create_graph=True)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ls = torch.log_softmax(h64 @ w64.T, -1)
    lt = torch.log_softmax(t_hidden.double() @ t_weight.double().T, -1)
    kl64 = (
        (lt.exp() * (lt - ls)).sum(-1) if direction == "forward" else (ls.exp() * (ls - lt)).sum(-1)
    )
    want_h, want_w = torch.autograd.grad(torch.where(labels != -100, kl64, 0).sum(), (h64, w64))
    assert (gh.double() - want_h).abs().max() < 1e-5 and (gw.double() - want_w).abs().max() < 1e-5
    assert gh.requires_grad and gw.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        (gh.pow(2).sum() + kl.sum()).backward()


def test_a_plain_backward_and_retain_graph_are_unchanged():
    hidden, weight, labels = _inputs(3)
    h = hidden.clone().requires_grad_()
    out = fused_head(h, weight, labels, top_k=2, return_lse=True)
    loss = out.log_probs.sum() + out.topk_log_probs.sum() + out.lse.sum()
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    assert not first.requires_grad
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first)
