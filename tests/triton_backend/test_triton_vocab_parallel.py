"""Vocab-parallel over 2 gloo CPU processes (interpreter), equal and uneven shards, fp32 and fp16.

Outputs are the full values on every rank, the same bits on both (NaN for an out-of-range label
on every rank); ``reduce_hidden_grad=True`` gives the full hidden gradient on every rank (summed
in fp32 for fp16 inputs, then rounded once), ``False`` each rank's partial, whose sum is the full
one; each rank's weight gradient is its shard's rows. Each is measured against one process over
the whole vocabulary on the same inputs and against float64 on the same input values.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import triton_tp_worker as tp
from triton_backend_helpers import (
    SUM_UNIT,
    TOLERANCE,
    assert_within_one_ulp,
    rel_err,
    sum_slack,
)

from fusedhead.reference import reference_fused_head

pytestmark = pytest.mark.multiprocess
WORLD = 2
U16 = 2.0**-11  # fp16's unit roundoff: one rounding to nearest moves a value by at most this
#: Against one process on the same inputs, (outputs, gradients). Outputs in either dtype, and
#: fp32 gradients: the same products, only the order of the fp32 sums differs. fp16 gradients:
#: dz is stored in fp16, so where the two runs' lse (that close) round a dz element to different
#: neighbours the gradient moves with it; bounded by one fp16 rounding (here most weight rows
#: are the same bits, the rest within 2e-6). The hidden gradient's sums are checked more
#: sharply below.
TOL = {"fp32": (2e-6, 2e-6), "fp16": (2e-6, U16)}
#: Against float64 on the same input values: the single-process bounds (outputs, gradients).
REF_TOL = {d: TOLERANCE[dtype] for d, dtype in tp.DTYPES.items()}
#: Additions to one hidden-gradient sum, at most: one per backward block (a multiple of the
#: 64-wide dz tile; a shard's last one may be short) and the cross-rank one.
ADDS = math.ceil(tp.V / tp.TILES["block_n"]) + WORLD
CASE_IDS = [(d, name) for d in tp.DTYPES for name in tp.CASES]
GOOD = torch.arange(tp.N) != tp.BAD_ROW


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
def single() -> dict[str, dict[str, dict]]:
    """The same cases in one process over the full weight, with the exact fp32 hidden-gradient
    sum (``memory="fast"``) that each rank keeps under a group; in fp32 both settings give the
    same bits (module-scoped: set the interpreter here, the per-test fixture has not run yet)."""
    x = tp.full_inputs()
    with pytest.MonkeyPatch.context() as mp_env:
        mp_env.setenv("TRITON_INTERPRET", "1")
        return {
            d: {
                name: tp.run_case(x, 0, tp.V, True, None, dtype, memory="fast", **case["kwargs"])
                for name, case in tp.CASES.items()
            }
            for d, dtype in tp.DTYPES.items()
        }


def _reference(d: str, name: str) -> dict[str, Any]:
    """float64 outputs and gradients of the worker's loss, on the values the ranks saw."""
    x = tp.full_inputs()
    kw = tp.CASES[name]["kwargs"]
    h = x["hidden"].to(tp.DTYPES[d]).double().requires_grad_()
    w = x["weight"].to(tp.DTYPES[d]).double().requires_grad_()
    temp = x["temps"].double() if kw.get("per_token") else 0.7
    lp, ent = reference_fused_head(
        h, w, x["labels"], temperature=temp, ignore_index=tp.IGNORE,
        return_entropy=kw.get("entropy", True), softcap=kw.get("softcap"),
        compute_dtype=torch.float64,
    )  # fmt: skip
    return tp.backward_outputs(lp, ent, h, w, x)


@pytest.mark.parametrize(("d", "name"), CASE_IDS)
def test_outputs_are_the_full_values_on_every_rank(
    ranks: list[dict], single: dict, d: str, name: str
) -> None:
    one, ref = single[d][name], _reference(d, name)
    tol, ref_tol = TOL[d][0], REF_TOL[d][0]
    for rank in ranks:
        got = rank[d][name]
        assert got["log_probs"].dtype == torch.float32
        assert torch.isnan(got["log_probs"][tp.BAD_ROW])
        assert rel_err(got["log_probs"][GOOD], one["log_probs"][GOOD]) <= tol
        assert rel_err(got["log_probs"][GOOD], ref["log_probs"][GOOD]) <= ref_tol
        if one["entropy"] is None:
            assert got["entropy"] is None
        else:
            assert got["entropy"].dtype == torch.float32
            assert rel_err(got["entropy"], one["entropy"]) <= tol
            assert rel_err(got["entropy"], ref["entropy"]) <= ref_tol
    # The ranks' statistics are all-gathered and combined in rank order: the same bits on each.
    a, b = ranks[0][d][name], ranks[1][d][name]
    assert torch.equal(a["log_probs"][GOOD], b["log_probs"][GOOD])
    assert a["entropy"] is None or torch.equal(a["entropy"], b["entropy"])


@pytest.mark.parametrize(("d", "name"), CASE_IDS)
def test_weight_gradient_is_each_shards_rows(
    ranks: list[dict], single: dict, d: str, name: str
) -> None:
    bounds = tp.CASES[name]["bounds"]
    for r, rank in enumerate(ranks):
        assert rank[d][name]["d_weight"].shape == (bounds[r + 1] - bounds[r], tp.H)
        assert rank[d][name]["d_weight"].dtype == tp.DTYPES[d]
    full = torch.cat([rank[d][name]["d_weight"] for rank in ranks])
    assert rel_err(full, single[d][name]["d_weight"]) <= TOL[d][1]
    assert rel_err(full, _reference(d, name)["d_weight"]) <= REF_TOL[d][1]


@pytest.mark.parametrize(("d", "name"), CASE_IDS)
def test_hidden_gradient_reduced_or_partial(
    ranks: list[dict], single: dict, d: str, name: str
) -> None:
    want, ref = single[d][name]["d_hidden"], _reference(d, name)["d_hidden"]
    assert all(rank[d][name]["d_hidden"].dtype == tp.DTYPES[d] for rank in ranks)
    if tp.CASES[name]["reduce"]:
        for rank in ranks:
            got = rank[d][name]["d_hidden"]
            if d == "fp16":
                # The ranks' fp32 partials summed in fp32, then rounded once: one process's
                # fp32 sum rounded, give or take the two sums' fp32 roundings (partials rounded
                # to fp16 before the sum fail this here, while within 2e-3 of float64).
                slack = sum_slack(want, 2 * ADDS, SUM_UNIT["fp32"])
                assert_within_one_ulp(got, want, slack=slack, what=name)
            else:
                assert rel_err(got, want) <= TOL[d][1]
            assert rel_err(got, ref) <= REF_TOL[d][1]
        assert torch.equal(ranks[0][d][name]["d_hidden"], ranks[1][d][name]["d_hidden"])
    else:
        parts = [rank[d][name]["d_hidden"].double() for rank in ranks]
        assert rel_err(parts[0], want) > 1e-3  # a partial, not the full gradient
        total = sum(parts)
        assert rel_err(total, ref) <= REF_TOL[d][1]
        if d == "fp16":
            # Each partial is rounded to fp16 once, as one process's gradient is (at most U16
            # of each value), after a running sum kept in fp24 (memory="low": 2^-16 of it an
            # addition): the partials' sum is one process's gradient within those roundings.
            part_unit = U16 + ADDS * SUM_UNIT["fp24"]
            bound = part_unit * sum(float(p.norm()) for p in parts) + U16 * float(want.norm())
            assert float((total - want.double()).norm()) <= bound
        else:
            assert rel_err(total, want) <= TOL[d][1]


def test_double_backward_is_refused_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert "double backward" in r["double_backward"], r["double_backward"]
