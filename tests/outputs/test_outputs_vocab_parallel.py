"""lse, sum_p2 and gather under ``process_group`` on the torch backend: the one-process values.

They fall out of the combine the log-probs already use (row max MAX-reduced, rebased sums summed,
each gathered id owned by one rank); top-k and argmax are not declared there and are refused.
"""

from __future__ import annotations

import socket
from pathlib import Path

import outputs_tp_worker as tp
import pytest
import torch
import torch.multiprocessing as mp

from fusedhead.errors import CapabilityError

WORLDS = [2, 3]
FIELDS = ("log_probs", "entropy", "lse", "sum_p2", "gathered")


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
def single() -> dict:
    return tp.run(tp.inputs(), 0, tp.V, True, None)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Only the order of the fp32 sums differs from one process (shards instead of blocks).
    scale = max(1.0, float(b.abs().max()))
    err = float((a - b).abs().max())
    assert err <= 2e-6 * scale, f"{what}: max abs err {err:.3g}"


@pytest.mark.parametrize("name", list(tp.CASES))
def test_every_rank_gets_the_one_process_values(ranks, single, name):
    for r, res in enumerate(ranks):
        for f in FIELDS:
            _close(res[name][f], single[f], f"rank {r} {name} {f}")


@pytest.mark.parametrize("name", list(tp.CASES))
def test_gradients_are_the_one_process_ones(ranks, single, name):
    world = len(ranks)
    bounds = tp.CASES[name]["bounds"][world]
    for r, res in enumerate(ranks):
        _close(
            res[name]["grad_weight"],
            single["grad_weight"][bounds[r] : bounds[r + 1]],
            f"rank {r} dW",
        )
    if tp.CASES[name]["reduce"]:
        for r, res in enumerate(ranks):
            _close(res[name]["grad_hidden"], single["grad_hidden"], f"rank {r} reduced dh")
    else:
        total = sum(res[name]["grad_hidden"] for res in ranks)
        _close(total, single["grad_hidden"], "sum of partial dh")


def test_topk_and_argmax_are_refused_under_a_process_group():
    from fusedhead.extras import capability_refusal
    from fusedhead.protocol import HeadCall
    from fusedhead_torch.backend import TorchBackend

    caps = TorchBackend().capabilities(torch.device("cpu"))
    h, w, y = torch.randn(3, 4), torch.randn(20, 4), torch.zeros(3, dtype=torch.long)
    for kw in ({"top_k": 2}, {"extras": frozenset({"argmax"})}):
        refusal = capability_refusal(HeadCall.make(h, w, y, process_group=object(), **kw), caps)
        assert refusal is not None and refusal[1] == "vocab_parallel_outputs"
    ok = HeadCall.make(
        h, w, y, process_group=object(), gather_ids=y[:, None], extras=frozenset({"lse", "sum_p2"})
    )
    assert capability_refusal(ok, caps) is None
    assert (
        CapabilityError
    )  # the core raises it with that capability (tests/outputs/test_torch_outputs.py)
