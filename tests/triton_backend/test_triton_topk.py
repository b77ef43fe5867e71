"""The triton top-k (``fusedhead_triton.topk``: the plain forward, candidate tiles, their recompute
and the selection) under the interpreter: ids exactly a stable descending sort's (equal logits by
the lower id), values against float64, the candidate tiles exact under ties, the recompute the
forward's bits, the statistics and extras a plain call's, batch invariance, and the refusals."""

from __future__ import annotations

import pytest
import torch
from triton_backend_helpers import IGNORE, SMALL_TILES

from fusedhead_triton.configs import settings_for
from fusedhead_triton.launch import (
    HeadScalars,
    PartialExtras,
    combine_extras,
    forward_partials,
    sort_ids,
)
from fusedhead_triton.topk import (
    MAX_TOP_K,
    TopK,
    candidate_tiles,
    finish,
    recompute,
    topk_partials,
)

DTYPES = [torch.float32, torch.float16]
IDS = ["fp32", "fp16"]
#: Odd sizes: a ragged row block and a ragged last vocabulary tile (64 columns per tile).
N, H, V = 37, 40, 333


def _dyadic(n: int, h: int, v: int, seed: int, spread: int = 4) -> tuple[torch.Tensor, ...]:
    """Inputs whose products and sums are exact in fp16 and fp32: logits are exact, with many
    exact ties (small integers / 128)."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randint(-8, 9, (n, h), generator=g) / 8
    w = torch.randint(-spread, spread + 1, (v, h), generator=g) / 16
    return hid, w, torch.randint(0, v, (n,), generator=g)


def _triples(w: torch.Tensor, seed: int) -> torch.Tensor:
    """``w`` with each of its first V/3 rows at three scattered ids: every logit ties twice."""
    third = w.shape[0] // 3
    g = torch.Generator().manual_seed(seed)
    out = w.clone()
    out[third : 2 * third] = w[:third][torch.randperm(third, generator=g)]
    out[2 * third : 3 * third] = w[:third][torch.randperm(third, generator=g)]
    return out


def _run(
    hid: torch.Tensor, w: torch.Tensor, lab: torch.Tensor, dtype: torch.dtype, k: int, *,
    temp: torch.Tensor | None = None, softcap: float | None = None, **kw: object,
) -> tuple[torch.Tensor, TopK]:  # fmt: skip
    cfg = settings_for(dtype, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, softcap)
    t = None if temp is None else temp.float().contiguous()
    p, top = topk_partials(hid.to(dtype), w.to(dtype), lab, t, sc, cfg, k, **kw)  # type: ignore[arg-type]
    return p.ws, top


def _reference(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of float64 logits: a stable descending sort, so equal values keep the lower id."""
    order = torch.sort(z, dim=1, descending=True, stable=True).indices[:, :k]
    return order, z.gather(1, order)


@pytest.mark.parametrize("k", [1, 4, 7, 32, 64])  # 1, 4: fewer than the 6 tiles (a floor)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_ids_are_a_stable_descending_sort_with_exact_ties(dtype: torch.dtype, k: int) -> None:
    hid, w, lab = _dyadic(N, H, V, seed=k)
    w = _triples(w, seed=k)
    z = hid.double() @ w.double().T
    ids, vals = _reference(z, k)
    srt = torch.sort(z, dim=1, descending=True).values
    assert bool((srt[:, k - 1] == srt[:, k]).any()), "the inputs must tie at the k-th value"
    _, top = _run(hid, w, lab, dtype, k)
    assert top.ids.dtype == torch.int64 and top.logits.dtype == torch.float32
    assert torch.equal(top.ids, ids)
    assert torch.equal(top.logits.double(), vals)  # exact products and sums


def test_all_equal_logits_give_the_lowest_ids() -> None:
    hid, _, lab = _dyadic(N, H, V, seed=1)
    w = torch.zeros(V, H)  # every logit 0: every tile ties, every column ties
    for k in (1, 33, 64):
        _, top = _run(hid, w, lab, torch.float32, k)
        assert torch.equal(top.ids, torch.arange(k).expand(N, k))
        assert bool((top.logits == 0).all())


def _reference_tiles(m: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` tiles of largest max per row (a stable sort: equal maxima keep the lower tile),
    ascending."""
    order = torch.sort(m.t(), dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values


@pytest.mark.parametrize(("t", "k"), [(20, 1), (20, 8), (20, 20), (64, 3), (150, 32), (150, 64)])
def test_candidate_tiles_are_exact_under_ties(t: int, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    n = 50
    m = torch.randint(-3, 4, (t, n), generator=g).float() / 4  # few values: ties everywhere
    m[:, :5] = 0.5  # rows whose tiles all tie
    m[3, 5] = -0.0  # -0.0 ties with +0.0
    m[:, 6] = -1e30
    got, floor = candidate_tiles(m, k)
    assert got.dtype == torch.int64 and got.shape == (n, k)
    assert torch.equal(got, _reference_tiles(m.where(m != 0, 0.0), k))
    assert torch.equal(got[:5], torch.arange(k).expand(5, k))
    assert torch.equal(floor, torch.sort(m, dim=0, descending=True).values[k - 1])  # k-th max
    every, none = candidate_tiles(m, t + 5)  # fewer tiles than k: all of them, no floor
    assert torch.equal(every, torch.arange(t).expand(n, t))
    assert bool((none == float("-inf")).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_recompute_is_the_forwards_z(dtype: torch.dtype) -> None:
    """At the chosen tiles the recomputed logits are the forward's bits: their maxima are the
    forward's tile maxima, and the top-k values are the forward's gathered logits at the ids."""
    g = torch.Generator().manual_seed(21)
    hid = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    lab = torch.randint(0, V, (N,), generator=g)
    temp = torch.rand(N, generator=g) + 0.5
    cfg = settings_for(dtype, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, 4.0)
    p, top = topk_partials(hid, w, lab, temp, sc, cfg, 9)
    tiles, floor = candidate_tiles(p.ws[0], 9)
    cand = recompute(hid, w, temp, sc, cfg, tiles)
    assert torch.equal(cand.amax(dim=2), p.ws[0].t().gather(1, tiles))
    ex = PartialExtras(gather=sort_ids(top.ids, lab, 0, V, IGNORE))
    at = forward_partials(hid, w, lab, temp, sc, cfg, ex)
    assert at.zg is not None
    zg = torch.empty_like(at.zg).scatter_(1, ex.gather.perm, at.zg)  # type: ignore[union-attr]
    assert torch.equal(top.logits, zg)
    ref = torch.sort(cand.reshape(N, -1), dim=1, descending=True, stable=True).values[:, :9]
    assert torch.equal(top.logits, ref)  # the selection keeps the candidates' best values
    assert bool((top.logits[:, -1] >= floor).all())  # what the selection may skip below


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_per_token_temperature_and_softcap(dtype: torch.dtype) -> None:
    hid, w, lab = _dyadic(N, H, V, seed=11)
    temp = torch.rand(N, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    cap = 3.0
    z = cap * torch.tanh((hid.double() @ w.double().T) / cap) / temp.float().double()[:, None]
    ids, vals = _reference(z, 32)  # softcap and 1/T keep the order and the exact ties
    _, top = _run(hid, w, lab, dtype, 32, temp=temp, softcap=cap)
    assert torch.equal(top.ids, ids)
    assert ((top.logits.double() - vals).abs() / vals.abs().clamp(min=1)).max() <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_random_inputs_against_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    hid = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    z = hid.double() @ w.double().T / 0.7
    ids, vals = _reference(z, 32)
    _, top = _run(hid, w, torch.zeros(N, dtype=torch.int64), dtype, 32, temp=torch.full((N,), 0.7))
    assert (top.logits.double() - vals).abs().max() <= 1e-5
    assert (z.gather(1, top.ids) - vals).abs().max() <= 1e-5  # a swap only between near-ties
    assert (top.ids == ids).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_statistics_are_the_plain_forwards_bits(dtype: torch.dtype) -> None:
    hid, w, lab = _dyadic(N, H, V, seed=3, spread=9)
    hid = hid + torch.randn(N, H, generator=torch.Generator().manual_seed(1)) / 64
    temp = torch.rand(N, generator=torch.Generator().manual_seed(6)) + 0.5
    cfg = settings_for(dtype, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, 5.0)
    h, ww = hid.to(dtype), w.to(dtype)
    p, _ = topk_partials(h, ww, lab, temp, sc, cfg, 8)
    ref = forward_partials(h, ww, lab, temp, sc, cfg)
    assert torch.equal(p.ws, ref.ws) and torch.equal(p.zy, ref.zy)


def test_extras_ride_along_unchanged() -> None:
    hid, w, lab = _dyadic(N, H, V, seed=8)
    cfg = settings_for(torch.float32, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, None)
    gids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(9))
    ex = PartialExtras(sum_p2=True, argmax=True, gather=sort_ids(gids, lab, 0, V, IGNORE))
    p, top = topk_partials(hid, w, lab, None, sc, cfg, 4, ex)
    ref = forward_partials(hid, w, lab, None, sc, cfg, ex)
    for a, b in zip(p, ref, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(top.ids, _reference(hid.double() @ w.double().T, 4)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_rows_top_k_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    hid, w, lab = _dyadic(N, H, V, seed=13)
    temp = torch.rand(N, generator=torch.Generator().manual_seed(7)) + 0.5
    _, top = _run(hid, w, lab, dtype, 7, temp=temp)
    _, again = _run(hid, w, lab, dtype, 7, temp=temp)
    assert torch.equal(again.ids, top.ids) and torch.equal(again.logits, top.logits)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    _, tp = _run(hid[perm], w, lab[perm], dtype, 7, temp=temp[perm])
    assert torch.equal(tp.ids, top.ids[perm]) and torch.equal(tp.logits, top.logits[perm])
    for sl in (slice(5, 9), slice(N - 1, N)):
        _, ts = _run(hid[sl], w, lab[sl], dtype, 7, temp=temp[sl])
        assert torch.equal(ts.ids, top.ids[sl]) and torch.equal(ts.logits, top.logits[sl])


@pytest.mark.parametrize(("v", "k"), [(7, 7), (50, 7), (64, 64), (65, 64)])
def test_small_vocabularies(v: int, k: int) -> None:
    hid, w, lab = _dyadic(9, H, v, seed=v)
    ids, vals = _reference(hid.double() @ w.double().T, k)
    _, top = _run(hid, w, lab, torch.float32, k)
    assert torch.equal(top.ids, ids) and torch.equal(top.logits.double(), vals)


@pytest.mark.parametrize(
    ("k", "v", "err", "match"),
    [
        (8, 7, ValueError, "top_k: 8 is more than the vocabulary's 7 ids"),
        (0, 100, ValueError, "top_k: the triton backend takes 1 to 64, got 0"),
        (MAX_TOP_K + 1, 100, ValueError, "got 65"),
        (2.0, 100, TypeError, "top_k: expected an int, got float"),
        (True, 100, TypeError, "top_k: expected an int, got bool"),
    ],
)
def test_refusals_name_top_k(k: object, v: int, err: type[Exception], match: str) -> None:
    hid, w, lab = _dyadic(3, 8, v, seed=0)
    with pytest.raises(err, match=match):
        _run(hid, w, lab, torch.float32, k)  # type: ignore[arg-type]


def test_finish_gives_log_probs_and_blanks_ignored_rows() -> None:
    hid, w, lab = _dyadic(N, H, V, seed=17)
    lab[::4] = IGNORE
    cfg = settings_for(torch.float32, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, None)
    p, top = topk_partials(hid, w, lab, None, sc, cfg, 5)
    rows = combine_extras(p, lab, IGNORE, entropy=False)
    out = finish(top, rows.row_max, rows.log_s, lab, IGNORE)
    ids, _ = _reference(hid.double() @ w.double().T, 5)
    logp = torch.log_softmax(hid.double() @ w.double().T, dim=1).gather(1, ids)
    keep = lab != IGNORE
    assert torch.equal(out.ids[keep], ids[keep]) and bool((out.ids[~keep] == -1).all())
    assert (out.logits[keep].double() - logp[keep]).abs().max() <= 1e-5
    assert bool((out.logits[~keep] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_no_rows_give_empty_top_k(dtype: torch.dtype) -> None:
    """N = 0: empty ids and logits of width k (no tile to choose, nothing launched)."""
    cfg = settings_for(dtype, **SMALL_TILES).forward
    sc = HeadScalars(0, IGNORE, 1.0, None)
    hid, w = torch.randn(0, H).to(dtype), torch.randn(V, H).to(dtype)
    _, top = topk_partials(hid, w, torch.zeros(0, dtype=torch.long), None, sc, cfg, 8)
    assert top.ids.shape == (0, 8) and top.ids.dtype == torch.int64
    assert top.logits.shape == (0, 8) and top.logits.dtype == torch.float32


def test_a_row_of_non_finite_logits_gives_ids_minus_one_never_past_the_vocabulary() -> None:
    """Before: a scored row whose hidden state held a NaN or an inf (a diverged step) had no
    candidate tile, and its ids decoded the selection's empty keys: about 2.7e11 with V = 20, an
    index a gather of the teacher's log-probs at those ids then went out of bounds with. Such a
    row reads -1, as its argmax does; the finite rows keep their ids."""
    from fusedhead import fused_head

    hid, w, lab = _dyadic(4, 8, 20, seed=3)
    hid[1, 2], hid[2] = float("nan"), float("inf")
    out = fused_head(hid, w, lab, backend="triton", top_k=3, return_argmax=True)
    assert out.topk_ids is not None and out.argmax is not None
    bad = torch.tensor([False, True, True, False])
    assert bool((out.topk_ids[bad] == -1).all()), out.topk_ids
    assert bool((out.argmax[bad] == -1).all()), out.argmax
    ids, _ = _reference(hid[~bad].double() @ w.double().T, 3)
    assert torch.equal(out.topk_ids[~bad], ids)
