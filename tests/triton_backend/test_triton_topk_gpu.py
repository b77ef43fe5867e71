"""The triton top-k kernel on a CUDA GPU (bf16 is checked here only: the interpreter's bf16 dot is
wrong): exact ties resolved by the lower id, values and log-probs against fp32 logits, the
forward's statistics bit for bit, batch invariance and determinism. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fusedhead_triton.configs import settings_for
from fusedhead_triton.launch import HeadScalars, combine, forward_partials
from fusedhead_triton.topk import TopK, finish, topk_partials

pytestmark = pytest.mark.gpu

IGNORE = -100
H, V = 4096, 151936


def _run(
    hid: torch.Tensor, w: torch.Tensor, lab: torch.Tensor, k: int,
    temp: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, TopK, torch.Tensor]:  # fmt: skip
    cfg = settings_for(hid.dtype).forward
    sc = HeadScalars(0, IGNORE, 1.0, softcap)
    with torch.no_grad():
        p, top = topk_partials(hid, w, lab, temp, sc, cfg, k)
        lse = combine(p, lab, IGNORE, entropy=False).lse
    return p.ws, top, lse


def _dyadic(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """bf16 inputs with exact products and sums, each weight row at three scattered ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = (torch.randint(-8, 9, (n, H), generator=g, device="cuda") / 8).to(torch.bfloat16)
    third = V // 3
    base = torch.randint(-4, 5, (third, H), generator=g, device="cuda") / 64
    rows = torch.cat([torch.randperm(third, generator=g, device="cuda") for _ in range(3)])
    w = base[rows].to(torch.bfloat16)
    return hid, w, torch.randint(0, V, (n,), generator=g, device="cuda")


@pytest.mark.parametrize("k", [1, 7, 32, 64])
def test_exact_ties_bf16(k: int) -> None:
    hid, w, lab = _dyadic(1937, seed=k)
    z = hid.double() @ w.double().T
    order = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k]
    _, top, _ = _run(hid, w, lab, k)
    assert torch.equal(top.ids, order)
    assert torch.equal(top.logits.double(), z.gather(1, order))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_values_and_log_probs_against_fp32_bf16(softcap: float | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 1024
    hid = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), generator=g, device="cuda")
    lab[::10] = IGNORE
    temp = torch.rand(n, generator=g, device="cuda") + 0.5
    _, top, lse = _run(hid, w, lab, 32, temp=temp, softcap=softcap)
    z = hid.float() @ w.float().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temp[:, None]
    ref = torch.topk(z, 32, dim=1).values
    assert (top.logits - ref).abs().max() <= 1e-4  # fp32 GEMM against fp32-accumulated bf16 tiles
    assert (z.gather(1, top.ids) - ref).abs().max() <= 1e-4  # a swap only between near-ties
    out = finish(top, lse, lab, IGNORE)
    logp = torch.log_softmax(z, dim=1).gather(1, top.ids)
    keep = lab != IGNORE
    assert (out.logits[keep] - logp[keep]).abs().max() <= 1e-4
    assert bool((out.ids[~keep] == -1).all()) and bool((out.logits[~keep] == 0).all())


def test_statistics_batch_invariance_and_determinism_bf16() -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    n = 1500
    hid = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), generator=g, device="cuda")
    ws, top, _ = _run(hid, w, lab, 32)
    cfg = settings_for(torch.bfloat16).forward
    with torch.no_grad():
        plain = forward_partials(hid, w, lab, None, HeadScalars(0, IGNORE, 1.0, None), cfg)
    # The tile maxima are order-free: the same logits give the same bits. The sums are reduced
    # in each program's own thread layout (64-row programs here, 128-row ones in the plain
    # forward), so on the GPU they agree to fp32 rounding rather than bit for bit.
    assert torch.equal(ws[0], plain.ws[0])
    torch.testing.assert_close(ws[1:], plain.ws[1:], rtol=2e-6, atol=0.0)
    _, again, _ = _run(hid, w, lab, 32)
    assert torch.equal(again.ids, top.ids) and torch.equal(again.logits, top.logits)
    for sl in (slice(0, 1), slice(700, 701), slice(333, 1111), slice(n - 1, n)):
        _, part, _ = _run(hid[sl], w, lab[sl], 32)
        assert torch.equal(part.ids, top.ids[sl]) and torch.equal(part.logits, top.logits[sl])
