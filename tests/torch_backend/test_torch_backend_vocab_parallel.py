"""Vocab-parallel over gloo: 2 and 3 CPU processes, equal and uneven shards, match one process.

Outputs are the full values on every rank; ``reduce_hidden_grad=True`` gives the full hidden
gradient on every rank, ``False`` each rank's partial, whose sum over ranks is the full one; each
rank's weight gradient is its shard's rows of the full weight gradient.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch_tp_worker as tp
from torch_backend_helpers import rel_err

pytestmark = pytest.mark.multiprocess

WORLDS = [2, 3]
TOL = 1e-6  # only the order of fp32 sums differs from one process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every case on ``world`` gloo processes (spawned once per world size), results by rank."""
    world = request.param
    out = tmp_path_factory.mktemp(f"torch-tp-{world}")
    mp.spawn(tp.worker, args=(world, _free_port(), str(out)), nprocs=world, join=True)
    results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    return results


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    """The same cases in one process over the full weight."""
    x = tp.full_inputs()
    return {
        name: tp.run_case(x, 0, tp.V, True, None, **dict(case.get("kwargs", {})))
        for name, case in tp.CASES.items()
    }


@pytest.mark.parametrize("name", list(tp.CASES))
def test_outputs_are_the_full_values_on_every_rank(
    ranks: list[dict], single: dict, name: str
) -> None:
    want = single[name]
    good = torch.ones(tp.N, dtype=torch.bool)
    good[tp.BAD_ROW] = False
    for rank in ranks:
        got = rank[name]
        assert torch.isnan(got["log_probs"][tp.BAD_ROW])
        assert rel_err(got["log_probs"][good], want["log_probs"][good]) <= TOL
        if want["entropy"] is None:
            assert got["entropy"] is None
        else:
            assert rel_err(got["entropy"], want["entropy"]) <= TOL


@pytest.mark.parametrize("name", list(tp.CASES))
def test_weight_gradient_is_each_shards_rows(ranks: list[dict], single: dict, name: str) -> None:
    bounds = tp.CASES[name]["bounds"][len(ranks)]
    for r, rank in enumerate(ranks):
        got = rank[name]["d_weight"]
        assert got.shape == (bounds[r + 1] - bounds[r], tp.H)
    full = torch.cat([rank[name]["d_weight"] for rank in ranks])
    assert rel_err(full, single[name]["d_weight"]) <= TOL


@pytest.mark.parametrize("name", [n for n, c in tp.CASES.items() if c["reduce"]])
def test_reduced_hidden_gradient_is_the_full_one_on_every_rank(
    ranks: list[dict], single: dict, name: str
) -> None:
    for rank in ranks:
        assert rel_err(rank[name]["d_hidden"], single[name]["d_hidden"]) <= TOL


@pytest.mark.parametrize("name", [n for n, c in tp.CASES.items() if not c["reduce"]])
def test_partial_hidden_gradients_sum_to_the_full_one(
    ranks: list[dict], single: dict, name: str
) -> None:
    partials = [rank[name]["d_hidden"] for rank in ranks]
    full = single[name]["d_hidden"]
    assert rel_err(sum(partials), full) <= TOL
    assert all(rel_err(p, full) > 0.05 for p in partials)  # each is only its shard's share


@pytest.mark.parametrize("name", [n for n in tp.CASES if n.startswith("nan-")])
def test_nan_in_an_ignored_rows_hidden_reaches_no_gradient(ranks: list[dict], name: str) -> None:
    x = tp.full_inputs()
    kwargs = {k: v for k, v in tp.CASES[name].get("kwargs", {}).items() if k != "nan_row"}
    clean = tp.run_case(x, 0, tp.V, True, None, **kwargs)  # the same case, hidden all finite
    for rank in ranks:
        dh = rank[name]["d_hidden"]
        assert torch.equal(dh[tp.NAN_ROW], torch.zeros(tp.H))
        assert torch.isfinite(dh).all() and torch.isfinite(rank[name]["d_weight"]).all()
        assert rank[name]["log_probs"][tp.NAN_ROW] == 0
    full = torch.cat([rank[name]["d_weight"] for rank in ranks])
    assert rel_err(full, clean["d_weight"]) <= TOL
