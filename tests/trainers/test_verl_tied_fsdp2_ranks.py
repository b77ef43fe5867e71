"""The fused policy loss of a tied-embedding model under verl's ``apply_fsdp2``, on two gloo ranks.

verl does not shard a tied ``lm_head`` on its own: the root unit holds the weight and, with
``reshard_after_forward: true`` (verl's default), reshards it after the model's forward, before
the loss runs. ``loss_mode: fusedhead`` runs the head inside the call of that unit
(:func:`fusedhead.integrations.verl_actor.weight_owner`), as ``fused_ppo_loss_step`` does here,
on each rank's own micro-batch. The gathered gradient of every parameter, the tied weight's
(head and embedding summed) included, equals the rank mean of the unsharded model's.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")
pytest.importorskip("transformers", reason="transformers is not installed")

HERE = Path(__file__).resolve().parent
LENGTHS = [5, 9, 3]
#: Seconds the two ranks get before the test fails as a hang.
TIMEOUT_S = 300


def _fused_loss(model: torch.nn.Module, micro_batch: Any, *, sharded: bool) -> str:
    """verl's engine feed through fusedhead's forward, which hands over the hidden states, then
    the fused policy loss in the weight owner's call (``sharded``) or ``lm_head``'s, backward.
    Returns the owner's class name."""
    from verl_helpers import engine

    from fusedhead.integrations import verl_actor
    from fusedhead.integrations.lm_head import in_module_call, lm_head_policy_loss

    inputs, _ = engine().prepare_model_inputs(micro_batch)
    slot = verl_actor._Pending(root=model)
    token = verl_actor._PENDING.set(slot)
    try:
        model(**inputs)
    finally:
        verl_actor._PENDING.reset(token)
    got = slot.take()
    assert got is not None, "fusedhead's forward did not hand the hidden states over"
    labels = got.labels.clone()
    labels[:, ::4] = -100
    gen = torch.Generator().manual_seed(int(labels.sum()))
    old = -3 + torch.randn(labels.shape, generator=gen)
    advantages = torch.randn(labels.shape, generator=gen)

    def body() -> tuple[torch.Tensor, ...]:
        out = lm_head_policy_loss(
            got.lm_head,
            got.hidden,
            labels,
            head=got.head,
            temperature=got.temperature,
            old_log_probs=old,
            advantages=advantages,
            entropy_coef=0.01,
            in_call=False,
        )
        return (out.loss,)

    owner = verl_actor.weight_owner(got.root, got.lm_head) if sharded else got.lm_head
    (loss,) = in_module_call(owner, body)
    loss.backward()
    return type(owner).__name__


def worker(rank: int, world: int, init: str, out_dir: str) -> None:
    """One rank: the unsharded references of every rank's batch, then its own batch sharded."""
    import torch.distributed as dist

    log = open(Path(out_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 - kept open for the run
    sys.stdout = sys.stderr = log
    try:
        import verl  # noqa: F401  # loads the verl.plugins entry points, fusedhead's included
        from torch.distributed.device_mesh import init_device_mesh
        from verl.utils.fsdp_utils import apply_fsdp2
        from verl_helpers import (
            apply_verl_monkey_patch,
            assert_fp32_close,
            packed_micro_batch,
            restored_verl_patches,
            tiny_qwen2,
        )

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        base = tiny_qwen2(0, tie=True)
        batches = [packed_micro_batch(LENGTHS, seed=10 + r) for r in range(world)]
        expected = []
        for micro_batch in batches:
            model = copy.deepcopy(base)
            with restored_verl_patches(type(model)):
                apply_verl_monkey_patch(model, "fusedhead:torch")
                _fused_loss(model, micro_batch, sharded=False)
            expected.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with restored_verl_patches(type(base)):
            model = copy.deepcopy(base)
            apply_verl_monkey_patch(model, "fusedhead:torch")
            mesh = init_device_mesh("cpu", (world,))
            apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
            owner = _fused_loss(model, batches[rank], sharded=True)
        assert owner == type(model).__name__, owner  # the root: verl gives lm_head no unit
        names = [name for name, _ in model.named_parameters()]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
        for name, p in model.named_parameters():
            mean = sum(e[name] for e in expected) / world
            assert_fp32_close(p.grad.full_tensor(), mean, f"grad of {name}")
        print(f"rank {rank}: tied head under apply_fsdp2 matches the unsharded model", flush=True)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        log.flush()
    os._exit(0)  # past the interpreter's teardown, as verl_fsdp_worker.py does


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_tied_head_under_verls_apply_fsdp2_on_two_gloo_ranks(tmp_path: Path) -> None:
    from spawned_ranks import run_ranks

    world = 2
    args = (world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path))
    run_ranks(worker, args, world, tmp_path, "the tied head's loss", TIMEOUT_S)
    for log in sorted(tmp_path.glob("rank*.log")):
        assert "tied head under apply_fsdp2 matches the unsharded model" in log.read_text()
