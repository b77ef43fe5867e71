"""Vocab-parallel through Liger's chunked TP path: two gloo processes match one process.

Outputs are the full values on every rank; ``reduce_hidden_grad=True`` gives the full hidden
gradient on every rank, ``False`` each rank's own partial (its shard's share), whose sum is the
full one; each rank's weight gradient is its shard's rows of the full weight gradient.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import liger_tp_worker as worker
import pytest
import torch

from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head

pytestmark = pytest.mark.multiprocess

WORLD = 2
WORKER = Path(worker.__file__)


def _spawn(tmp: Path, *mode: str, timeout: float = 300) -> list[dict]:
    """Run WORLD gloo worker processes; their saved results, by rank."""
    rendezvous = tmp / "rendezvous"
    outs = [tmp / f"rank{r}.pt" for r in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(WORLD), str(rendezvous), str(outs[r]), *mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op on a process that has exited; frees a rank left in a collective
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r]}"
    return [torch.load(o) for o in outs]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run WORLD gloo processes once; their saved results, by rank."""
    return _spawn(tmp_path_factory.mktemp("liger-tp"))


@pytest.fixture(scope="module")
def shard_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's outcome of every ``SHARD_CASES`` case (separate processes: a rank left
    waiting in a collective fails these tests only, after ``timeout``)."""
    return _spawn(tmp_path_factory.mktemp("liger-tp-shards"), "shards", timeout=120)


@pytest.fixture(scope="module")
def truth() -> dict[str, torch.Tensor]:
    """Float64 full-logits answers, with per-shard partial hidden gradients."""
    x = worker.full_inputs()
    labels = x["labels"].clone()
    labels[worker.BAD_ROW] = worker.IGNORE
    h = x["hidden"].double().requires_grad_()
    w = x["weight"].double().requires_grad_()
    u = h @ w.T  # gradient w.r.t. u splits by vocabulary shard
    u.retain_grad()
    lp, ent = reference_fused_head(
        h, w, labels, temperature=worker.T, ignore_index=worker.IGNORE, compute_dtype=torch.float64
    )
    # Same values through u, to get dL/du for the per-shard partials.
    z = u / worker.T
    logp = torch.log_softmax(z, -1)
    valid = labels != worker.IGNORE
    safe = labels.clamp_min(0)
    lp_u = torch.where(valid, logp.gather(-1, safe[:, None])[:, 0], 0.0)
    ent_u = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (lp_u * x["g_lp"] + ent_u * x["g_ent"]).sum().backward()
    local = worker.V // WORLD
    partials = [
        u.grad[:, r * local : (r + 1) * local] @ w.detach()[r * local : (r + 1) * local]
        for r in range(WORLD)
    ]
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "dh": h.grad,
        "dw": w.grad,
        "partials": partials,
    }


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = (a.double() - b.double()).norm() / b.double().norm()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


def _valid_rows() -> torch.Tensor:
    return torch.arange(worker.N) != worker.BAD_ROW


@pytest.mark.parametrize("mode", ["reduce", "partial", "no_entropy"])
def test_outputs_are_full_values_on_every_rank(ranks: list[dict], truth: dict, mode: str) -> None:
    ok = _valid_rows()
    for r in ranks:
        _close(r[mode]["lp"][ok], truth["lp"][ok])
        if mode == "no_entropy":
            assert r[mode]["ent"] is None
        else:
            _close(r[mode]["ent"][ok], truth["ent"][ok])
    assert torch.equal(ranks[0][mode]["lp"][ok], ranks[1][mode]["lp"][ok])


def test_out_of_range_label_gives_nan_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert torch.isnan(r["reduce"]["lp"][worker.BAD_ROW])
        assert torch.isfinite(r["reduce"]["lp"][_valid_rows()]).all()


def test_reduce_hidden_grad_true_gives_the_full_hidden_gradient(
    ranks: list[dict], truth: dict
) -> None:
    for r in ranks:
        _close(r["reduce"]["dh"], truth["dh"])


def test_reduce_hidden_grad_false_gives_each_ranks_partial(ranks: list[dict], truth: dict) -> None:
    for rank, r in enumerate(ranks):
        _close(r["partial"]["dh"], truth["partials"][rank])
    _close(sum(r["partial"]["dh"] for r in ranks), truth["dh"])
    # A partial is not the full gradient (the test could fail).
    assert (ranks[0]["partial"]["dh"] - truth["dh"]).norm() > 0.1 * truth["dh"].norm()


@pytest.mark.parametrize("mode", ["reduce", "partial"])
def test_weight_gradient_is_the_shards_rows(ranks: list[dict], truth: dict, mode: str) -> None:
    local = worker.V // WORLD
    for rank, r in enumerate(ranks):
        _close(r[mode]["dw"], truth["dw"][rank * local : (rank + 1) * local])


def test_matches_one_process_of_the_same_backend(ranks: list[dict]) -> None:
    from fusedhead_liger import LigerBackend, LigerOptions

    x = worker.full_inputs()
    h = x["hidden"].clone().requires_grad_()
    w = x["weight"].clone().requires_grad_()
    lp, ent = call_backend(LigerBackend(LigerOptions(implementation="fallback")),
        h, w, x["labels"], temperature=worker.T, ignore_index=worker.IGNORE, return_entropy=True,
        process_group=None, vocab_start=0, vocab_size=worker.V, reduce_hidden_grad=True,
    )  # fmt: skip
    ok = _valid_rows()
    (lp[ok] * x["g_lp"][ok] + ent[ok] * x["g_ent"][ok]).sum().backward()
    for r in ranks:
        _close(r["reduce"]["lp"][ok], lp[ok].detach(), 1e-6)
        _close(r["reduce"]["ent"][ok], ent[ok].detach(), 1e-6)
        _close(r["reduce"]["dh"], h.grad, 1e-6)


def test_through_the_core(ranks: list[dict], truth: dict) -> None:
    if "core" not in ranks[0]:
        pytest.skip("fusedhead.api.fused_head is not there yet")
    local = worker.V // WORLD
    for rank, r in enumerate(ranks):
        _close(r["core"]["lp"], truth["lp"])
        _close(r["core"]["ent"], truth["ent"])
        _close(r["core"]["dh"], truth["dh"])
        _close(r["core"]["dw"], truth["dw"][rank * local : (rank + 1) * local])


@pytest.mark.parametrize(
    "name,words",
    [
        ("unequal_rows", ["vocab_size must be the same on every rank", "[800, 1200]"]),
        ("unequal_core_defaults", ["vocab_size must be the same on every rank", "[800, 1200]"]),
        ("gap", ["vocab_size=1000 is larger than the union", "ids [400, 500), [900, 1000)"]),
        ("overlap", ["shards of process_group overlap at id 400"]),
    ],
)
def test_shards_that_disagree_raise_the_same_named_error_on_every_rank(
    shard_ranks: list[dict], name: str, words: list[str]
) -> None:
    """Each rank's own equal-shard check passes on 400 rows of 800 beside 600 of 1200, so only
    the gathered shards show that the union is not the vocabulary; every rank must say so."""
    for r, rank in enumerate(shard_ranks):
        kind, msg = rank[name]
        assert kind == "ValueError", (r, kind, msg)
        for word in words:
            assert word in msg, (r, word, msg)
        assert "rank 0: [" in msg and "rank 1: [" in msg, msg  # every rank's shard shown
        assert f"this rank ({r}) passed vocab_start=" in msg, msg
    # One message on every rank but for the clause naming the rank's own arguments.
    assert len({rank[name][1].split("; this rank")[0] for rank in shard_ranks}) == 1


def test_shards_out_of_rank_order_are_one_backend_error_judged_from_every_ranks_shard(
    shard_ranks: list[dict],
) -> None:
    """Liger's TP path needs equal shards in rank order; the verdict comes from the gathered
    shards, so every rank raises it alike (with 3+ ranks a layout can fail on some ranks only,
    which judged per rank would leave the others waiting in Liger's collectives)."""
    msgs = []
    for r, rank in enumerate(shard_ranks):
        kind, msg = rank["out_of_order"]
        assert kind == "BackendUnavailableError", (r, kind, msg)
        assert "equal contiguous vocabulary shards in rank order" in msg, msg
        assert "ranks [0, 1] do not" in msg and "rank 0: [500, 1000) of 1000" in msg, msg
        msgs.append(msg.split("; this is rank")[0])
    assert len(set(msgs)) == 1


def test_shards_that_cover_the_vocabulary_still_run_after_the_errors(
    ranks: list[dict], shard_ranks: list[dict]
) -> None:
    """The check leaves the group usable: equal shards after the errors give the full values."""
    outs = [rank["covered_again"] for rank in shard_ranks]
    for kind, lp in outs:
        assert kind == "ok", lp
    assert torch.equal(outs[0][1], outs[1][1])
    same = _valid_rows() & (worker.full_inputs()["labels"] < 800)  # the labels the cases keep
    _close(outs[0][1][same], ranks[0]["reduce"]["lp"][same], 1e-6)
