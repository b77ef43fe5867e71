"""FSDP2 (``fully_shard``) on two gloo CPU processes: sharded results equal the unsharded ones.

FusedLMHead reads its weight inside its own forward, where FSDP2 has unsharded it; the
transformers helper runs the decoder body and the head inside the root's (and a separately
sharded lm_head's) forward. Outputs and gradients (gathered with ``full_tensor()``) are compared
with an unsharded copy of the same model run on both ranks' batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed"),
]


#: Seconds the two ranks get before the test fails as a hang.
TIMEOUT_S = 300


def _spawn(scenarios: list[str], tmp_path: Path) -> None:
    """Run the scenarios on 2 gloo ranks (file rendezvous: no port to race for)."""
    from fsdp_worker import worker
    from spawned_ranks import run_ranks

    args = (2, f"file://{tmp_path / 'rendezvous'}", scenarios, str(tmp_path))
    run_ranks(worker, args, 2, tmp_path, str(scenarios), TIMEOUT_S)


def test_fused_lm_head_alone_and_tied_embeddings_under_fsdp2(tmp_path: Path) -> None:
    _spawn(["head_only", "tied"], tmp_path)


def test_the_fused_policy_loss_with_the_lm_head_sharded_under_fsdp2(tmp_path: Path) -> None:
    _spawn(["policy_loss"], tmp_path)


def test_transformers_helper_under_fsdp2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _spawn(["llama", "llama_head_sharded", "gemma2_tied_softcap"], tmp_path)


def test_a_dtensor_weight_outside_fsdp_forward_is_refused_with_the_fix() -> None:
    """Calling forward directly on a sharded head (bypassing FSDP's hooks) gives a clear error."""
    from fusedhead import FusedLMHead
    from fusedhead.checks import is_dtensor

    class FakeDTensor(torch.nn.Parameter):
        pass

    FakeDTensor.__name__ = "DTensor"
    head = FusedLMHead(torch.nn.Parameter(torch.randn(5, 4)), {"backend": "torch"})
    head.weight = FakeDTensor(torch.randn(5, 4))
    assert is_dtensor(head.weight)
    with pytest.raises(RuntimeError, match="FSDP2 did not unshard it"):
        head(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))
