"""A top-k id may equal ``ignore_index`` when that is a valid id (a pad token's id): its log-prob
is the row's like any other, and so is its gradient. Before, both backends returned the value and
dropped its gradient, as for a gathered id equal to ``ignore_index`` (a constant 0, rightly)."""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head

BACKENDS = ["torch", "triton"]  # triton under TRITON_INTERPRET=1 on the CPU (tests/conftest.py)


def _case() -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 8, generator=g, dtype=torch.float64)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64)
    pad = int((h @ w.T).argmax(-1)[0])  # row 0's most likely id, used as ignore_index
    labels = torch.tensor([1, 2, 3, pad])  # rows 0-2 scored, row 3 ignored
    return h, w, pad, labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_top_k_id_equal_to_ignore_index_keeps_its_gradient(backend: str) -> None:
    h64, w64, pad, labels = _case()
    ref_h = h64.clone().requires_grad_()
    ref_lp = torch.log_softmax(ref_h @ w64.T, -1)
    (ref_grad,) = torch.autograd.grad(ref_lp[0, pad], ref_h)
    h = h64.float().requires_grad_()
    out = fused_head(h, w64.float(), labels, backend=backend, top_k=2, ignore_index=pad)
    assert out.topk_ids is not None and out.topk_log_probs is not None
    assert int(out.topk_ids[0, 0]) == pad
    assert out.topk_log_probs[0, 0].item() == pytest.approx(ref_lp[0, pad].item(), rel=1e-5)
    (grad,) = torch.autograd.grad(out.topk_log_probs[0, 0], h)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gathered_id_equal_to_ignore_index_stays_a_constant_zero(backend: str) -> None:
    h64, w64, pad, labels = _case()
    h = h64.float().requires_grad_()
    ids = torch.tensor([[pad, 5]] * 4)
    out = fused_head(h, w64.float(), labels, backend=backend, gather_ids=ids, ignore_index=pad)
    assert out.gathered is not None
    assert torch.equal(out.gathered[:, 0], torch.zeros(4))
    (grad,) = torch.autograd.grad(out.gathered[:, 0].sum(), h, retain_graph=True)
    assert not grad.any()
    ref_h = h64.clone().requires_grad_()
    ref = torch.log_softmax(ref_h @ w64.T, -1)[:3, 5].sum()
    (ref_grad,) = torch.autograd.grad(ref, ref_h)
    (grad,) = torch.autograd.grad(out.gathered[:, 1].sum(), h)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
