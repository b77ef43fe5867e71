"""Tile planning respects its budget; row statistics of slices merge exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedhead_torch.rowstats import RowStats
from fusedhead_torch.tiling import GRID_COLS, MIN_AUTO_COLS, plan_tiles

MIB = 1 << 20


@pytest.mark.parametrize("n", [1, 37, 2048, 8192, 32768])
@pytest.mark.parametrize("v", [1, 101, 32000, 151936])
def test_auto_tiles_cover_everything_within_the_budget(n: int, v: int) -> None:
    tiles = plan_tiles(n, v, bytes_per_element=10, budget_bytes=64 * MIB)
    assert 1 <= tiles.rows <= n and 1 <= tiles.cols <= v
    assert tiles.rows * tiles.cols * 10 <= 64 * MIB
    rows = list(tiles.row_ranges(n))
    cols = list(tiles.col_ranges(v))
    assert rows[0][0] == 0 and rows[-1][1] == n and cols[0][0] == 0 and cols[-1][1] == v
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cols))


def test_auto_tiles_keep_all_rows_and_cut_the_vocabulary_evenly() -> None:
    """Blocks of whole forward grid tiles (the backward recomputes with the forward's GEMMs),
    as equal as that allows: every block but the last equal, the last not empty."""
    tiles = plan_tiles(8192, 151936, bytes_per_element=10, budget_bytes=1024 * MIB)
    assert tiles.rows == 8192 and tiles.cols % GRID_COLS == 0
    widths = [b - a for a, b in tiles.col_ranges(151936)]
    assert len(set(widths[:-1])) == 1 and 0 < widths[-1] <= widths[0]


def test_auto_tiles_chunk_rows_rather_than_make_narrow_blocks() -> None:
    tiles = plan_tiles(100_000, 151936, bytes_per_element=10, budget_bytes=64 * MIB)
    assert tiles.cols >= MIN_AUTO_COLS and tiles.rows < 100_000


def test_explicit_sizes_win() -> None:
    assert (
        plan_tiles(
            37, 101, bytes_per_element=8, budget_bytes=MIB, chunk_rows=10, block_vocab=16
        ).rows
        == 10
    )
    tiles = plan_tiles(37, 101, bytes_per_element=8, budget_bytes=MIB, block_vocab=16)
    assert tiles.cols == 16 and tiles.rows == 37


def _stats(z: torch.Tensor) -> RowStats:
    m = z.max(dim=1).values
    e = torch.exp(z - m[:, None])
    return RowStats(m, e.sum(1), (e * (z - m[:, None])).sum(1))


def test_merged_slices_give_full_log_sum_exp_and_entropy() -> None:
    z = torch.randn(6, 50, dtype=torch.float64) * 5
    z[0, :30] -= 200  # one slice far below the other
    merged = _stats(z[:, :30]).merged(_stats(z[:, 30:42])).merged(_stats(z[:, 42:]))
    logp = torch.log_softmax(z, dim=1)
    torch.testing.assert_close(merged.log_sum_exp(), torch.logsumexp(z, dim=1))
    torch.testing.assert_close(merged.entropy(), -(logp.exp() * logp).sum(1))


def test_an_empty_slice_merges_without_nan() -> None:
    z = torch.randn(4, 10)
    full = _stats(z)
    merged = RowStats.empty(4, torch.device("cpu")).merged(full)
    torch.testing.assert_close(merged.log_sum_exp(), full.log_sum_exp())
    torch.testing.assert_close(merged.entropy(), full.entropy())
