"""fused_policy_loss under DistributedDataParallel, on 2 gloo CPU processes.

A module that returned the whole ``PolicyLossOutput`` under ``static_graph=True`` never
all-reduced: DDP finds a module's output tensors with ``tree_flatten``, and the output was one
opaque leaf, so every rank kept its own gradient (off by 80 % from the whole batch's, no error).
"""

from __future__ import annotations

import ddp_policy_worker as dw
import pytest
import torch
from gloo_ranks import spawn_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[torch.Tensor]]]:
    return spawn_ranks("ddp_policy_worker", dw.WORLD, tmp_path_factory.mktemp("ddp"), "torch")


@pytest.mark.parametrize("mode", list(dw.MODES))
def test_every_rank_gets_the_whole_batchs_gradient(ranks: list[dict], mode: str) -> None:
    whole = dw.train(dw.PolicyHead("torch"), slice(None), float(dw.ROWS * dw.SEQ))
    for rank, result in enumerate(ranks):
        for step, (got, want) in enumerate(zip(result[mode], whole, strict=True)):
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-5, f"rank {rank} step {step}: weight gradient off by {err:.2e}"


def test_the_output_flattens_to_its_tensors_and_back() -> None:
    hidden, labels, advantages = dw.batch(0)
    out = dw.PolicyHead("torch")(hidden, labels, advantages, 20.0)
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    tensors = [t for t in leaves if t is not None]
    assert leaves[0] is out.loss and len(tensors) == 3 + len(out.metrics())  # loss, lp, entropy
    back = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert type(back) is type(out) and back.loss is out.loss
    assert back.metrics().keys() == out.metrics().keys()
