"""Vocab-parallel: the shards' union against ``vocab_size``, on 2 gloo CPU processes.

A ``vocab_size`` larger than the union of the shards used to run silently (a label in the gap
got log-prob 0 on torch, NaN on triton; the log-sum-exp left the gap out). Each rank's shard now
rides in the combine's own collective (no extra one), and every rank raises the same named
``ValueError``; overlapping shards and ranks that disagree on ``vocab_size`` likewise.
"""

from __future__ import annotations

import pytest
import shard_check_worker as sw
import torch
from gloo_ranks import spawn_ranks

from fusedhead.shards import _shard_ints, shard_slots

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=["torch", "triton"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"shards-{request.param}")
    return spawn_ranks("shard_check_worker", sw.WORLD, out, request.param)


@pytest.mark.parametrize(
    "name,words",
    [
        ("gap_at_the_end", ["vocab_size=20 is larger than the union", "ids [16, 20) in no shard"]),
        ("gap_in_the_middle", ["vocab_size=18 is larger than the union", "ids [8, 10) in no"]),
        ("gap_with_extras", ["vocab_size=20 is larger than the union", "[16, 20)"]),
        ("overlap", ["shards of process_group overlap at id 8"]),
        ("sizes_differ", ["vocab_size must be the same on every rank", "[16, 18]"]),
        ("uneven_defaults", ["vocab_size must be the same on every rank", "[12, 20]"]),
    ],
)
def test_every_rank_raises_the_same_named_error(ranks, name, words):
    for r, rank in enumerate(ranks):
        kind, msg = rank[name]
        assert kind == "ValueError", (r, kind, msg)
        for word in words:
            assert word in msg, (r, word, msg)
        assert "rank 0: [" in msg and "rank 1: [" in msg, msg  # every rank's shard shown
        assert f"this rank ({r}) passed vocab_start=" in msg, msg
    # One message on every rank but for the clause naming the rank's own arguments.
    assert len({rank[name][1].split("; this rank")[0] for rank in ranks}) == 1


def test_a_label_out_of_range_is_raised_on_every_rank_after_the_collectives(ranks):
    """The checks of a vocab-parallel call are read after the backend's collectives, so a check
    that fails on one rank alone cannot leave another waiting in them (uneven_defaults above)."""
    for r, rank in enumerate(ranks):
        kind, msg = rank["label_out_of_range"]
        assert kind == "ValueError", (r, kind, msg)
        assert "labels must be in [0, 16)" in msg and "got 16 at flat position 3" in msg, msg


@pytest.mark.parametrize("name", ["covered", "covered_uneven", "covered_again"])
def test_shards_that_cover_vocab_size_run(ranks, name):
    outs = []
    for rank in ranks:
        kind, lp = rank[name]
        assert kind == "ok", lp
        assert torch.isfinite(lp).all()
        outs.append(lp)
    assert torch.equal(outs[0], outs[1])  # every rank gets the full outputs


@pytest.mark.parametrize("value", [0, 1, 2**21 - 1, 2**21, 151936, 2**40 + 3, 2**63 - 1])
def test_shard_bounds_travel_exactly_in_fp32(value):
    slots = torch.tensor(shard_slots(value, 7, value), dtype=torch.float32)
    zeros = torch.zeros_like(slots)
    summed = (slots + zeros + zeros).tolist()  # what a SUM all-reduce over other slots does
    assert _shard_ints(summed) == (value, 7, value)
