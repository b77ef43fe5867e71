"""A batch whose every label is ignore_index (a micro-batch of prompt tokens only): every
output is its zeros (ids -1) in the labels' shape, with zero gradients, on every first-party
backend that runs here.

The torch backend skips ignored rows on the CPU; with no row left, its extras came back with
0 rows and the core refused them as a broken contract (``log_probs must be float32 [6]``).
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import fused_head

EXTRAS = {
    "lse": {"return_lse": True},
    "sum_p2": {"return_sum_p2": True},
    "argmax": {"return_argmax": True},
    "topk": {"top_k": 3},
    "gather": {"gather_ids": torch.zeros(2, 3, 2, dtype=torch.long)},
}
#: (backend, options) by test id: the torch backend with and without skipping ignored rows.
CASES = {
    "torch-skip-rows": ("torch", {"skip_ignored_rows": True}),
    "torch-all-rows": ("torch", {"skip_ignored_rows": False}),
    "triton": ("triton", {"block_m": 16, "block_n": 16, "block_k": 16}),
}


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize(("backend", "options"), list(CASES.values()), ids=list(CASES))
def test_every_output_of_an_all_ignored_batch_is_zero(backend, options, extra):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g).requires_grad_()
    labels = torch.full((2, 3), -100)
    out = fused_head(hidden, weight, labels, backend=backend, options=options, **EXTRAS[extra])
    loss = out.log_probs.sum() + out.entropy.sum()
    for name in ("lse", "sum_p2", "topk_log_probs", "gathered"):
        t = getattr(out, name)
        if t is not None:
            assert t.shape[:2] == (2, 3) and t.dtype == torch.float32, name
            assert bool((t == 0).all()), name
            loss = loss + t.sum()
    for name in ("argmax", "topk_ids"):
        t = getattr(out, name)
        if t is not None:
            assert t.shape[:2] == (2, 3) and bool((t == -1).all()), name
    assert bool((out.log_probs == 0).all()) and out.log_probs.shape == (2, 3)
    loss.backward()
    assert bool((hidden.grad == 0).all()) and bool((weight.grad == 0).all())
