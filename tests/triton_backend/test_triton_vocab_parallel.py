"""Vocab-parallel over 2 gloo CPU processes (interpreter), equal and uneven shards.

Outputs are the full values on every rank (NaN for an out-of-range label on every rank);
``reduce_hidden_grad=True`` gives the full hidden gradient on every rank, ``False`` each rank's
partial, whose sum is the full one; each rank's weight gradient is its shard's rows.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import triton_tp_worker as tp
from triton_backend_helpers import rel_err

from fusedhead.reference import reference_fused_head

pytestmark = pytest.mark.multiprocess
WORLD = 2
TOL = 2e-6  # against one process: only the order of fp32 sums differs
REF_TOL = 1e-5  # against float64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("triton-tp")
    mp.spawn(tp.worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    """The same cases in one process over the full weight (module-scoped: set the interpreter
    here, the per-test fixture has not run yet)."""
    x = tp.full_inputs()
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("TRITON_INTERPRET", "1")
        return {
            name: tp.run_case(x, 0, tp.V, True, None, **case["kwargs"])
            for name, case in tp.CASES.items()
        }


def _reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = tp.full_inputs()
    kw = tp.CASES[name]["kwargs"]
    temp = x["temps"].double() if kw.get("per_token") else 0.7
    lp, ent = reference_fused_head(
        x["hidden"].double(), x["weight"].double(), x["labels"], temperature=temp,
        softcap=kw.get("softcap"), compute_dtype=torch.float64,
    )  # fmt: skip
    return lp, ent


@pytest.mark.parametrize("name", list(tp.CASES))
def test_outputs_are_the_full_values_on_every_rank(
    ranks: list[dict], single: dict, name: str
) -> None:
    good = torch.ones(tp.N, dtype=torch.bool)
    good[tp.BAD_ROW] = False
    ref_lp, ref_ent = _reference(name)
    for rank in ranks:
        got = rank[name]
        assert torch.isnan(got["log_probs"][tp.BAD_ROW])
        assert rel_err(got["log_probs"][good], single[name]["log_probs"][good]) <= TOL
        assert rel_err(got["log_probs"][good], ref_lp[good]) <= REF_TOL
        if single[name]["entropy"] is None:
            assert got["entropy"] is None
        else:
            assert rel_err(got["entropy"], single[name]["entropy"]) <= TOL
            assert rel_err(got["entropy"], ref_ent) <= REF_TOL
    assert torch.equal(ranks[0][name]["log_probs"][good], ranks[1][name]["log_probs"][good])


@pytest.mark.parametrize("name", list(tp.CASES))
def test_weight_gradient_is_each_shards_rows(ranks: list[dict], single: dict, name: str) -> None:
    bounds = tp.CASES[name]["bounds"]
    for r, rank in enumerate(ranks):
        assert rank[name]["d_weight"].shape == (bounds[r + 1] - bounds[r], tp.H)
    full = torch.cat([rank[name]["d_weight"] for rank in ranks])
    assert rel_err(full, single[name]["d_weight"]) <= TOL


@pytest.mark.parametrize("name", list(tp.CASES))
def test_hidden_gradient_reduced_or_partial(ranks: list[dict], single: dict, name: str) -> None:
    want = single[name]["d_hidden"]
    if tp.CASES[name]["reduce"]:
        for rank in ranks:
            assert rel_err(rank[name]["d_hidden"], want) <= TOL
        assert torch.equal(ranks[0][name]["d_hidden"], ranks[1][name]["d_hidden"])
    else:
        parts = [rank[name]["d_hidden"] for rank in ranks]
        assert rel_err(parts[0], want) > 1e-3  # a partial, not the full gradient
        assert rel_err(sum(parts), want) <= TOL


def test_double_backward_is_refused_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert "double backward" in r["double_backward"], r["double_backward"]
