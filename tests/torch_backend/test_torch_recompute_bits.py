"""The backward recomputes each logit with the forward's GEMM of the same shape, so its logits
are the forward's bits on any BLAS.

A GEMM's rounding may depend on its shape: MKL's fp32 GEMM on an AMD EPYC gives another last bit
to a logit computed among 16 columns than among 70. The backward divides ``exp(k x - m)`` by the
forward's sums, and at T = 1e-10 one ulp of ``x`` is thousands in ``k x``: such a machine gave
gradients 7 % off at T = 1e-10 (and 1.3e-4 at T = 1e-4) while the forward walked the 1024-column
vocabulary grid and the backward its own blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch_backend_helpers import (
    IGNORE,
    TOLERANCE,
    make_case,
    rel_err,
    run_backend,
    run_reference,
)

from fusedhead_torch import TorchOptions
from fusedhead_torch.tile_math import forward_logits, logits_mm
from fusedhead_torch.tiling import GRID_COLS, Tiles, plan_forward_tiles, plan_tiles

MIB = 1 << 20


def _bounds(ranges: Iterator[tuple[int, int]]) -> set[int]:
    return {edge for r in ranges for edge in r}


@pytest.mark.parametrize("n", [1, 37, 2048, 8192, 32768, 300_000])
@pytest.mark.parametrize("v", [1, 101, 1000, 1025, 32000, 151936])
@pytest.mark.parametrize("budget_mib", [1, 32, 1024])
@pytest.mark.parametrize("chunk_rows", [None, 512])
def test_auto_backward_tiles_are_whole_forward_tiles(
    n: int, v: int, budget_mib: int, chunk_rows: int | None
) -> None:
    """Every edge of a backward tile is an edge of the forward's: no logit is computed twice."""
    sizes: dict[str, Any] = {"bytes_per_element": 12, "budget_bytes": budget_mib * MIB}
    back = plan_tiles(n, v, chunk_rows=chunk_rows, **sizes)
    grid = plan_forward_tiles(n, v, chunk_rows=chunk_rows, **sizes)
    assert _bounds(back.row_ranges(n)) <= _bounds(grid.row_ranges(n))
    assert _bounds(back.col_ranges(v)) <= _bounds(grid.col_ranges(v))
    assert back.rows * back.cols * 12 <= max(budget_mib * MIB, grid.rows * grid.cols * 12)


@pytest.mark.parametrize("n", [37, 8192, 300_000])
@pytest.mark.parametrize("v", [1000, 16384, 151936])
@pytest.mark.parametrize("block_vocab", [16, 1000, 1024, 2048, 4096])
def test_explicit_blocks_take_whole_forward_row_chunks(n: int, v: int, block_vocab: int) -> None:
    """``block_vocab`` alone: the forward's rows fit a tile of that width, so the backward's rows
    are whole forward chunks (on the grid, its columns too): nothing is recomputed twice."""
    sizes: dict[str, Any] = {"bytes_per_element": 10, "budget_bytes": 32 * MIB}
    back = plan_tiles(n, v, block_vocab=block_vocab, **sizes)
    grid = plan_forward_tiles(n, v, block_vocab=block_vocab, **sizes)
    assert _bounds(back.row_ranges(n)) <= _bounds(grid.row_ranges(n))
    if block_vocab % GRID_COLS == 0 or v <= block_vocab:
        assert _bounds(back.col_ranges(v)) <= _bounds(grid.col_ranges(v))
    assert back.rows * back.cols * 10 <= 32 * MIB and grid.rows * grid.cols * 10 <= 32 * MIB


def test_wide_blocks_are_whole_grid_tiles_of_near_equal_count() -> None:
    tiles = plan_tiles(8192, 151936, bytes_per_element=10, budget_bytes=1024 * MIB)
    assert tiles.rows == 8192 and tiles.cols % GRID_COLS == 0
    grid_tiles = -(-151936 // GRID_COLS)
    per_block = tiles.cols // GRID_COLS
    assert per_block * (-(-grid_tiles // per_block) - 1) < grid_tiles  # no block of nothing


@pytest.mark.parametrize(
    ("rows", "cols"),
    [
        ((0, 21), (0, 26)),  # whole forward tiles: written in place
        ((7, 14), (13, 26)),  # exactly one forward tile: its own GEMM
        ((3, 18), (5, 40)),  # cutting forward tiles: computed whole, the overlap kept
        ((20, 23), (39, 45)),  # the ragged corner
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_logits_are_the_forward_tiles_gemms(
    rows: tuple[int, int], cols: tuple[int, int], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(23, 64, generator=gen).to(dtype)
    w = torch.randn(45, 64, generator=gen).to(dtype)
    grid = Tiles(7, 13)
    want = torch.empty(23, 45)
    for (a, b), (c, d) in itertools.product(grid.row_ranges(23), grid.col_ranges(45)):
        want[a:b, c:d] = logits_mm(h[a:b], w[c:d].T, True)
    got = forward_logits(h, w, rows, cols, grid, fp32=True)
    assert got.dtype == torch.float32
    assert torch.equal(got, want[rows[0] : rows[1], cols[0] : cols[1]])


def _shape_dependent_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.mm`` as a BLAS whose last bit depends on the shape: ``(rows + cols) % 5`` ulps up."""
    mm = torch.mm

    def shape_ulps(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        y = mm(a, b, **kwargs)
        if y.dtype == torch.float32:
            for _ in range((a.shape[0] + b.shape[1]) % 5):
                y.copy_(torch.nextafter(y, torch.full_like(y, float("inf"))))
        return y

    monkeypatch.setattr(torch, "mm", shape_ulps)


@pytest.mark.parametrize("temperature", [1e-10, 1e-4])
@pytest.mark.parametrize(
    "options",
    [
        TorchOptions(chunk_rows=10, block_vocab=16),  # blocks narrower than the grid
        TorchOptions(chunk_rows=6, block_vocab=1030),  # rows and blocks across forward tiles
        TorchOptions(workspace_mib=1),  # the auto plan
    ],
    ids=["narrow", "across", "auto"],
)
def test_a_shape_dependent_gemm_gives_the_forwards_logits_to_the_backward(
    monkeypatch: pytest.MonkeyPatch, temperature: float, options: TorchOptions
) -> None:
    case = make_case(29, 16, 2101)
    want = run_reference(case, temperature=temperature)
    _shape_dependent_mm(monkeypatch)
    got = run_backend(case, options=options, temperature=temperature)
    out_tol, grad_tol = TOLERANCE["fp32"]
    kept = case.labels != IGNORE
    assert rel_err(got.log_probs[kept], want.log_probs[kept]) <= out_tol
    assert rel_err(got.d_hidden, want.d_hidden) <= grad_tol
    assert rel_err(got.d_weight, want.d_weight) <= grad_tol


def test_the_extra_outputs_backward_recomputes_the_forwards_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gather path's backward (``outputs``) walks its own blocks too."""
    import fusedhead

    case = make_case(29, 16, 70, ignore_every=0)
    ids = torch.tensor([0, 5, 69]).repeat(29, 1)
    temperature = 1e-10
    h64 = case.hidden.clone().requires_grad_()
    log_p = torch.log_softmax((h64 @ case.weight.T) / temperature, dim=-1)
    (log_p.gather(1, ids).sum(1) * case.g_lp).sum().backward()
    _shape_dependent_mm(monkeypatch)
    h = case.hidden.float().requires_grad_()
    got = fusedhead.fused_head(
        h,
        case.weight.float(),
        case.labels,
        temperature=temperature,
        backend="torch",
        options={"chunk_rows": 10, "block_vocab": 16},
        gather_ids=ids,
    )
    assert got.gathered is not None
    (got.gathered.sum(-1) * case.g_lp.float()).sum().backward()
    assert h.grad is not None and h64.grad is not None
    assert rel_err(h.grad, h64.grad) <= TOLERANCE["fp32"][1]


@pytest.mark.parametrize("compiler", ["aot_eager"])
def test_a_block_of_several_grid_tiles_compiles_with_fullgraph(compiler: str) -> None:
    """A backward block of two grid tiles (written side by side outside a trace) compiles whole,
    to the eager bits: Dynamo takes no ``out=`` into a column slice, so it gets a copy."""
    import fusedhead

    case = make_case(40, 32, 3000)
    options = {"block_vocab": 2048, "workspace_mib": 64}

    def loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lp, ent = fusedhead.fused_head(
            h, w, case.labels, temperature=0.7, backend="torch", options=options
        )
        return lp.sum() + ent.sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, dynamic=False, backend=compiler)):
        h = case.hidden.float().requires_grad_()
        w = case.weight.float().requires_grad_()
        value = fn(h, w)
        value.backward()
        results.append((value.detach(), h.grad, w.grad))
    eager, compiled = results
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
