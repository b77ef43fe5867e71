"""A vocab-parallel head under ``torch.compile(fullgraph=True)``: the compiled step's loss and
gradients are the eager step's on every rank (two gloo CPU ranks, uneven shards). AOTAutograd
traces the forward's collectives and the backward's hidden-gradient all-reduce together; a
saved tensor that aliases an output would fail it, and a reduction left out would show here."""

from __future__ import annotations

from pathlib import Path

import compiled_tp_worker as cw
import pytest
import torch
from gloo_ranks import spawn_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("compiled-tp")
    return spawn_ranks("compiled_tp_worker", cw.WORLD, out, "torch")


@pytest.mark.parametrize("what", ["loss", "d_hidden", "d_weight"])
def test_the_compiled_step_is_the_eager_step_on_every_rank(ranks: list[dict], what: str) -> None:
    for rank, got in enumerate(ranks):
        eager, compiled = got["eager"][what], got["compiled"][what]
        assert compiled is not None and torch.isfinite(compiled).all(), (rank, what)
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")


def test_every_rank_has_the_full_hidden_gradient(ranks: list[dict]) -> None:
    """reduce_hidden_grad=True (the default): the compiled backward all-reduced it."""
    torch.testing.assert_close(ranks[0]["compiled"]["d_hidden"], ranks[1]["compiled"]["d_hidden"])
