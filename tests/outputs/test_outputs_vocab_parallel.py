"""Every output past (log_probs, entropy) under ``process_group`` on the torch backend: the one-process values.

lse, sum_p2 and gather fall out of the combine the log-probs already use (row max MAX-reduced,
rebased sums summed, each gathered id owned by one rank); top-k and argmax merge every rank's
candidates, equal logits by the lower global id whatever order the shards lie in. Each rank gets
the one-process ids exactly, the values and the gradients up to the order of fp32 sums.
"""

from __future__ import annotations

import socket
from pathlib import Path

import outputs_tp_worker as tp
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiprocess

WORLDS = [2, 3]
FIELDS = ("log_probs", "entropy", "lse", "sum_p2", "gathered", "topk_log_probs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = request.param
    out = tmp_path_factory.mktemp(f"outputs-tp-{world}")
    mp.spawn(tp.worker, args=(world, _free_port(), str(out)), nprocs=world, join=True)
    return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    """Each case in one process over the whole weight."""
    return {
        name: tp.run(
            tp.inputs(case.get("inputs", "random")),
            0,
            tp.V,
            True,
            None,
            case.get("top_k", tp.TOP_K),
        )
        for name, case in tp.CASES.items()
    }


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Only the order of the fp32 sums differs from one process (shards instead of blocks).
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= 2e-6 * scale, f"{what}: max abs err {err:.3g}"


@pytest.mark.parametrize("name", list(tp.CASES))
def test_every_rank_gets_the_one_process_values(ranks, single, name):
    for r, res in enumerate(ranks):
        for f in FIELDS:
            _close(res[name][f], single[name][f], f"rank {r} {name} {f}")


@pytest.mark.parametrize("name", list(tp.CASES))
def test_every_rank_gets_the_one_process_top_k_ids_and_argmax(ranks, single, name):
    want_ids, want_argmax = single[name]["topk_ids"], single[name]["argmax"]
    scored = tp.inputs()["labels"] != -100
    assert bool((want_ids[~scored] == -1).all()) and bool((want_argmax[~scored] == -1).all())
    for r, res in enumerate(ranks):
        got = res[name]["topk_ids"]
        assert torch.equal(got, want_ids), (
            f"rank {r} {name}: top-k ids differ in rows "
            f"{(got != want_ids).any(1).nonzero().squeeze(1).tolist()}"
        )
        assert torch.equal(res[name]["argmax"], want_argmax), f"rank {r} {name}: argmax differs"
        assert torch.equal(res[name]["argmax"], got[:, 0])


def test_the_tie_cases_have_ties_across_shards(single):
    """The integer-logit inputs do what they are for: equal top-k logits on both sides of a boundary."""
    x = tp.inputs("ties")
    logits = x["hidden"] @ x["weight"].T
    ids = single["ties-reversed-shards"]["topk_ids"]
    scored = x["labels"] != -100
    vals = logits.gather(1, ids.clamp(min=0))[scored]
    ids = ids[scored]
    # Pairs of neighbours in the ranking with equal logits, one id below 60 and one above.
    same = vals[:, 1:] == vals[:, :-1]
    crossing = (ids[:, 1:] >= 60) != (ids[:, :-1] >= 60)
    assert int((same & crossing).sum()) > 10
    # And the ranking broke them by the lower id.
    assert bool((ids[:, 1:] > ids[:, :-1])[same].all())


@pytest.mark.parametrize("name", list(tp.CASES))
def test_gradients_are_the_one_process_ones(ranks, single, name):
    world = len(ranks)
    case = tp.CASES[name]
    for r, res in enumerate(ranks):
        start, stop = tp.shard(case, world, r)
        _close(
            res[name]["grad_weight"],
            single[name]["grad_weight"][start:stop],
            f"rank {r} dW",
        )
    if case["reduce"]:
        for r, res in enumerate(ranks):
            _close(res[name]["grad_hidden"], single[name]["grad_hidden"], f"rank {r} reduced dh")
    else:
        total = sum(res[name]["grad_hidden"] for res in ranks)
        _close(total, single[name]["grad_hidden"], "sum of partial dh")


def test_top_k_and_argmax_are_declared_under_a_process_group():
    from fusedhead.contract import gate_head
    from fusedhead.protocol import HeadCall
    from fusedhead_torch.backend import TorchBackend

    caps = TorchBackend().capabilities(torch.device("cpu"))
    assert set(caps.vocab_parallel_outputs) == set(caps.outputs)
    h, w, y = torch.randn(3, 4), torch.randn(20, 4), torch.zeros(3, dtype=torch.long)
    for kw in ({"top_k": 2}, {"extras": frozenset({"argmax"})}):
        call = HeadCall.make(h, w, y, process_group=object(), **kw)
        assert gate_head(call, caps, {}) is call  # passes the gate unchanged


def test_a_nan_logit_in_another_ranks_shard_leaves_every_row_without_ids(ranks):
    """Before: gloo's MAX all-reduce dropped the NaN from some rows' max, and those rows named the
    NaN column (or another) as their argmax on every rank, where one process gives -1."""
    single = tp.nan_column_ids(0, tp.V, None)
    scored = tp.inputs()["labels"] != -100
    assert bool(single["log_probs"][scored].isnan().all())
    assert bool((single["argmax"] == -1).all()) and bool((single["topk_ids"] == -1).all())
    for r, res in enumerate(ranks):
        got = res["nan-column"]
        assert torch.equal(got["argmax"], single["argmax"]), f"rank {r}: {got['argmax'].tolist()}"
        assert torch.equal(got["topk_ids"], single["topk_ids"]), f"rank {r}"
