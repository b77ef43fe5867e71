"""Batch invariance (bitwise, torch.equal) and run-to-run determinism, under the interpreter.

A row's log-prob and entropy must not depend on which other rows share its batch, nor on N:
permuted, sliced, single-row and larger batches give the same bits. Forward and backward give
the same bits when run twice.
"""

from __future__ import annotations

import pytest
import torch
from triton_backend_helpers import IGNORE, SMALL_TILES, make_case

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions

N, H, V = 70, 72, 333


def _forward(h: torch.Tensor, w: torch.Tensor, lab: torch.Tensor, t: float | torch.Tensor):
    be = TritonBackend(TritonOptions(**SMALL_TILES))
    with torch.no_grad():
        return call_backend(be,
            h, w, lab, temperature=t, ignore_index=IGNORE, return_entropy=True,
            process_group=None, vocab_start=0, vocab_size=w.shape[0], reduce_hidden_grad=True,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("per_token", [False, True], ids=["T-float", "T-per-token"])
def test_a_rows_outputs_do_not_depend_on_the_batch(dtype: torch.dtype, per_token: bool) -> None:
    case = make_case(N, H, V, seed=21)
    h, w, lab = case.hidden.to(dtype), case.weight.to(dtype), case.labels
    g = torch.Generator().manual_seed(3)
    temp = torch.rand(N, generator=g) + 0.5 if per_token else 0.7

    def t_of(idx: torch.Tensor | slice) -> float | torch.Tensor:
        return temp[idx] if isinstance(temp, torch.Tensor) else temp

    lp, ent = _forward(h, w, lab, temp)

    perm = torch.randperm(N, generator=g)
    lp_p, ent_p = _forward(h[perm], w, lab[perm], t_of(perm))
    assert torch.equal(lp_p, lp[perm]) and torch.equal(ent_p, ent[perm])

    sl = slice(5, 43)  # starts inside a row tile, spans two
    lp_s, ent_s = _forward(h[sl], w, lab[sl], t_of(sl))
    assert torch.equal(lp_s, lp[sl]) and torch.equal(ent_s, ent[sl])

    for i in (0, 33, N - 1):
        one = slice(i, i + 1)
        lp_1, ent_1 = _forward(h[one], w, lab[one], t_of(one))
        assert torch.equal(lp_1, lp[one]) and torch.equal(ent_1, ent[one])

    extra = make_case(45, H, V, seed=22)
    big_h = torch.cat([extra.hidden.to(dtype), h])
    big_t = torch.cat([torch.rand(45, generator=g) + 0.5, temp]) if per_token else temp
    lp_b, ent_b = _forward(big_h, w, torch.cat([extra.labels, lab]), big_t)
    assert torch.equal(lp_b[45:], lp) and torch.equal(ent_b[45:], ent)


def test_forward_and_backward_are_deterministic() -> None:
    case = make_case(N, H, V, seed=23)
    runs = []
    for _ in range(2):
        h = case.hidden.float().requires_grad_()
        w = case.weight.float().requires_grad_()
        be = TritonBackend(TritonOptions(**SMALL_TILES, backward_block_mib=1e-3))
        lp, ent = call_backend(be,
            h, w, case.labels, temperature=0.7, ignore_index=IGNORE, return_entropy=True,
            process_group=None, vocab_start=0, vocab_size=V, reduce_hidden_grad=True,
        )  # fmt: skip
        (lp * case.g_lp.float() + ent * case.g_ent.float()).sum().backward()
        runs.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
