"""The triton top-k on a CUDA GPU in bf16 (checked here only: the interpreter's bf16 dot is wrong),
at N = 3001..8192, H = 4096, V = 151936: exact ties resolved by the lower id, values and log-probs
against fp32 logits, the recomputed tiles the forward's bits (their maxima the forward's tile
maxima, the values the gathered logits at the ids), every other output a plain call's bit for bit,
batch invariance and determinism. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from fusedhead_triton.configs import settings_for
from fusedhead_triton.launch import HeadScalars, combine, forward_partials
from fusedhead_triton.outputs import forward_values
from fusedhead_triton.topk import TopK, candidate_tiles, finish, recompute, topk_partials

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
        norm = combine(p, lab, IGNORE, entropy=False).norm  # each row's max and log s
    return p.ws, top, norm


def _random(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(V, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    lab = torch.randint(0, V, (n,), generator=g, device="cuda")
    lab[::10] = IGNORE
    return hid, w, lab, torch.rand(n, generator=g, device="cuda") + 0.5


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
    hid, w, lab = _dyadic(3001, seed=k)
    z = hid.float() @ w.float().T  # exact: small integers / 512
    order = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k]
    _, top, _ = _run(hid, w, lab, k)
    assert torch.equal(top.ids, order)
    assert torch.equal(top.logits, z.gather(1, order))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_values_and_log_probs_against_fp32_bf16(softcap: float | None) -> None:
    hid, w, lab, temp = _random(3001, seed=1)
    _, top, norm = _run(hid, w, lab, 32, temp=temp, softcap=softcap)
    z = hid.float() @ w.float().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temp[:, None]
    ref = torch.topk(z, 32, dim=1).values
    assert (top.logits - ref).abs().max() <= 1e-4  # fp32 GEMM against fp32-accumulated bf16 tiles
    assert (z.gather(1, top.ids) - ref).abs().max() <= 1e-4  # a swap only between near-ties
    out = finish(top, norm[0], norm[1], lab, IGNORE)
    logp = torch.log_softmax(z, dim=1).gather(1, top.ids)
    keep = lab != IGNORE
    assert (out.logits[keep] - logp[keep]).abs().max() <= 1e-4
    assert bool((out.ids[~keep] == -1).all()) and bool((out.logits[~keep] == 0).all())


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_recomputed_tiles_are_the_forwards_bits_bf16(softcap: float | None) -> None:
    hid, w, lab, temp = _random(8192, seed=3)
    cfg = settings_for(torch.bfloat16).forward
    sc = HeadScalars(0, IGNORE, 1.0, softcap)
    with torch.no_grad():
        p = forward_partials(hid, w, lab, temp, sc, cfg)
        tiles, _ = candidate_tiles(p.ws[0], 32)
        cand = recompute(hid, w, temp, sc, cfg, tiles)
    assert torch.equal(cand.amax(dim=2), p.ws[0].t().gather(1, tiles))


def test_outputs_are_a_plain_calls_bits_bf16() -> None:
    """log_probs, entropy, lse (and the backward's norm), sum_p2 and argmax of a call with top-k
    are a plain call's, and the top-k log-probs the gathered log-probs at the top-k ids, bit for
    bit."""
    hid, w, lab, temp = _random(8192, seed=4)
    cfg = settings_for(torch.bfloat16).forward
    sc = HeadScalars(0, IGNORE, 1.0, None)
    kw = dict(entropy=True, sum_p2=True, argmax=True)
    with torch.no_grad():
        top = forward_values(hid, w, lab, temp, None, sc, cfg, top_k=32, **kw)  # type: ignore[arg-type]
        keep = (lab != IGNORE).unsqueeze(1)
        ids = torch.where(keep, top.topk_ids, 0)
        plain = forward_values(hid, w, lab, temp, ids, sc, cfg, top_k=0, **kw)  # type: ignore[arg-type]
    for name in ("log_probs", "norm", "entropy", "lse_out", "sum_p2", "argmax"):
        assert torch.equal(getattr(top, name), getattr(plain, name)), name
    assert torch.equal(top.topk_log_probs, torch.where(keep, plain.gathered, 0.0))
    assert torch.equal(top.argmax, top.topk_ids[:, 0])


def test_batch_invariance_and_determinism_bf16() -> None:
    hid, w, lab, temp = _random(8192, seed=2)
    _, top, _ = _run(hid, w, lab, 32, temp=temp)
    _, again, _ = _run(hid, w, lab, 32, temp=temp)
    assert torch.equal(again.ids, top.ids) and torch.equal(again.logits, top.logits)
    for sl in (slice(0, 1), slice(700, 701), slice(333, 3334), slice(8191, 8192)):
        _, part, _ = _run(hid[sl], w, lab[sl], 32, temp=temp[sl])
        assert torch.equal(part.ids, top.ids[sl]) and torch.equal(part.logits, top.logits[sl])
