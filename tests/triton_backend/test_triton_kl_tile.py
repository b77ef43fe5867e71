"""The triton KL's two layouts under the interpreter (``kl.KL_TILE``): "single256" (one head's
tile at a time, one head's tile parked in a per-program scratch tile and read back in 1, 2, 4 or 8
column pieces) against "dual128" (both heads' tiles at once) and float64 full logits; which
kernels each layout launches; the pointer-load path; the knobs' errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_triton_kl import DIRECTIONS, Heads, _reference
from triton_backend_helpers import IGNORE, SMALL_TILES, TOLERANCE, rel_err

from fusedhead_triton import TritonBackend, TritonOptions
from fusedhead_triton import kl as kl_mod
from fusedhead_triton.configs import TileConfig
from fusedhead_triton.kl import KLScalars, kl_grads, kl_tile, kl_values
from fusedhead_triton.launch import kernel


class _Spy:
    """Counts the launches of one kernel and forwards them."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.launches = fn, 0

    def __getitem__(self, grid: Any) -> Any:
        self.launches += 1
        return self.fn[grid]


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Spy]:
    k = kernel("kl")
    out = {}
    for name in (
        "kl_stats_kernel",
        "kl_stats_single_kernel",
        "kl_dz_kernel",
        "kl_dz_single_kernel",
    ):
        out[name] = _Spy(getattr(k, name))
        monkeypatch.setattr(k, name, out[name])
    return out


def _run(
    heads: Heads, dtype: torch.dtype, direction: str, layout: str, split: int = 2,
    options: dict[str, Any] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """(kl, lse_s, lse_t, dh, dW) of the launchers with ``layout`` (T = 0.7 and 1.3)."""
    hs, ws = heads.hidden.to(dtype), heads.weight.to(dtype)
    ht, wt = heads.t_hidden.to(dtype), heads.t_weight.to(dtype)
    valid = heads.labels != IGNORE
    be = TritonBackend(TritonOptions(**(options or SMALL_TILES), backward_block_mib=1e-3))
    st = be._settings(dtype)[0]
    cfg = kl_tile(st.forward, layout)
    sc = KLScalars(1 / 0.7, 1 / 1.3, None, None, direction == "reverse")
    out = kl_values(hs, ws, ht, wt, valid, None, None, sc, cfg, layout=layout, split=split)
    coef = torch.where(valid, heads.g.float(), 0.0)
    dh, dw = kl_grads(hs, ws, ht, wt, None, None, out[1], out[2], out[0], coef, sc, st,
                      kl_tile(st.dz, layout), need_dh=True, need_dw=True, layout=layout,
                      split=split)  # fmt: skip
    assert dh is not None and dw is not None
    return [*out, dh, dw]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_piece_gives_the_dual_tiles_bits(direction: str, spies: dict[str, _Spy]) -> None:
    """At the same tile and one piece, the single-head kernels fold the same values in the same
    order: the KL and both log-sum-exps are bitwise the dual kernels'; so is dz in the forward
    direction (the reverse parks log p_t + KL: one rounding differs)."""
    heads = Heads(37, 48, 40, 301, seed=31)
    single = _run(heads, torch.float16, direction, "single256", split=1)
    assert spies["kl_stats_single_kernel"].launches == 1
    assert spies["kl_dz_single_kernel"].launches > 1  # several backward blocks
    assert spies["kl_stats_kernel"].launches == spies["kl_dz_kernel"].launches == 0
    dual = _run(heads, torch.float16, direction, "dual128", split=1)
    assert spies["kl_stats_kernel"].launches == 1 and spies["kl_dz_kernel"].launches > 1
    for a, b in zip(single[:3], dual[:3]):
        assert torch.equal(a, b)
    if direction == "forward":
        assert all(torch.equal(a, b) for a, b in zip(single[3:], dual[3:]))
    else:
        assert all(
            rel_err(a, b) <= TOLERANCE[torch.float16][1] for a, b in zip(single[3:], dual[3:])
        )


@pytest.mark.parametrize("split", [1, 2, 4, 8])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_split_matches_float64(split: int, direction: str) -> None:
    """Ragged last tiles, a teacher of another hidden size, ignored rows, tiles of 4 pieces."""
    heads = Heads(29, 40, 24, 333, seed=32)
    got = _run(heads, torch.float16, direction, "single256", split=split)
    want = _reference(heads, torch.float16, direction, 0.7, 1.3)
    out_tol, grad_tol = TOLERANCE[torch.float16]
    assert rel_err(got[0], want[0]) <= out_tol
    assert rel_err(got[3], want[1]) <= grad_tol and rel_err(got[4], want[2]) <= grad_tol
    assert torch.all(got[0][heads.labels == IGNORE] == 0)
    assert torch.all(got[3][heads.labels == IGNORE] == 0)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pieces_keep_a_rows_bits_whatever_the_batch(direction: str) -> None:
    """Batch invariance of the scratch path: a row's KL and log-sum-exps depend only on its own
    data (rows of one tile sliced, permuted, alone); a second run repeats every output bitwise.
    (dh is left out of the first: memory-bound backward blocks are as wide as N allows.)"""
    heads = Heads(40, 32, 48, 260, seed=33)

    def rows(pick: slice | torch.Tensor) -> list[torch.Tensor]:
        sub = Heads.__new__(Heads)
        sub.hidden, sub.t_hidden = heads.hidden[pick], heads.t_hidden[pick]
        sub.weight, sub.t_weight = heads.weight, heads.t_weight
        sub.labels, sub.g = heads.labels[pick], heads.g[pick]
        return _run(sub, torch.float16, direction, "single256", split=2)

    full = rows(slice(None))
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    for pick in (perm, slice(7, 30), slice(13, 14)):
        got = rows(pick)
        assert all(torch.equal(a, b[pick]) for a, b in zip(got[:3], full[:3]))
    assert all(torch.equal(a, b) for a, b in zip(rows(slice(None)), full))


def test_pointer_loads_take_the_dual_tiles(spies: dict[str, _Spy]) -> None:
    """fp32 (and odd H) read through pointers: "single256" launches the dual kernels, at most
    ``KL_MAX_BLOCK_N`` wide, and gives their bits."""
    heads = Heads(21, 33, 20, 150, seed=34)
    single = _run(heads, torch.float32, "forward", "single256", options={**SMALL_TILES})
    assert spies["kl_stats_single_kernel"].launches == spies["kl_dz_single_kernel"].launches == 0
    dual = _run(heads, torch.float32, "forward", "dual128")
    assert all(torch.equal(a, b) for a, b in zip(single, dual))
    # fp16 with an odd hidden size: no TMA, so the dual kernels too
    _run(Heads(9, 33, 24, 90, seed=35), torch.float16, "reverse", "single256")
    assert spies["kl_stats_single_kernel"].launches == 0 and spies["kl_stats_kernel"].launches == 3


def test_the_shipped_layout_is_read_at_the_call(
    monkeypatch: pytest.MonkeyPatch, spies: dict[str, _Spy]
) -> None:
    """``KL_TILE`` decides the layout of a call through the backend (what the GPU A/B flips)."""
    heads = Heads(12, 32, 16, 100, seed=36)
    call = [t.half() for t in (heads.hidden, heads.weight, heads.t_hidden, heads.t_weight)]
    be = TritonBackend(TritonOptions(**SMALL_TILES))
    from fusedhead.protocol import KLCall

    valid = heads.labels != IGNORE
    results = {}
    for layout in kl_mod.KL_LAYOUTS:
        monkeypatch.setattr(kl_mod, "KL_TILE", layout)
        with torch.no_grad():
            results[layout] = be.kl(KLCall(*call, valid, 0.7, 1.3, "forward")).kl
    assert spies["kl_stats_single_kernel"].launches == 1 and spies["kl_stats_kernel"].launches == 1
    assert rel_err(results["single256"], results["dual128"]) <= TOLERANCE[torch.float16][0]


def test_unknown_layout_and_split_are_refused_by_name() -> None:
    heads = Heads(4, 16, 16, 40, seed=37)
    cfg = TileConfig(16, 32, 16, tma=True)
    with pytest.raises(ValueError, match=r"^layout: 'dual256' is not a KL layout"):
        kl_tile(cfg, "dual256")
    with pytest.raises(ValueError, match=r"^split: 3 is not one of \(1, 2, 4, 8\)"):
        _run(heads, torch.float16, "forward", "single256", split=3)


def test_narrow_tiles_take_fewer_pieces_of_at_least_16_bytes() -> None:
    """A 16-column fp16 tile has 2 pieces of 8 columns at most (TMA's 16-byte minimum width of
    dz's block): asking for 8 gives the bits of 2; either matches float64."""
    heads = Heads(19, 32, 16, 120, seed=38)
    tiny = {"block_m": 16, "block_n": 16, "block_k": 16}
    eight = _run(heads, torch.float16, "reverse", "single256", split=8, options=tiny)
    two = _run(heads, torch.float16, "reverse", "single256", split=2, options=tiny)
    assert all(torch.equal(a, b) for a, b in zip(eight, two))
    want = _reference(heads, torch.float16, "reverse", 0.7, 1.3)
    assert rel_err(eight[0], want[0]) <= TOLERANCE[torch.float16][0]
