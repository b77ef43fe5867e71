"""One gloo CPU rank of the verl FSDP2 tests: verl's own ``apply_fsdp2`` on a tiny Qwen2.

``apply_fsdp2`` shards every decoder layer, the untied ``embed_tokens`` and ``lm_head`` each on
their own, then the root. Inside the root's forward the LM head's weight is therefore still a
DTensor shard; fusedhead reads it inside ``lm_head``'s own call, where FSDP2 has gathered it.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from verl_helpers import (
    apply_verl_monkey_patch,
    assert_fp32_close,
    engine_log_probs,
    packed_micro_batch,
    restored_verl_patches,
    scored,
    tiny_qwen2,
)

LENGTHS = [5, 9, 3]
ENTROPY_WEIGHT = 0.3


def _sharded(backend: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.fsdp_utils import apply_fsdp2

    model = tiny_qwen2(0)
    apply_verl_monkey_patch(model, backend)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    apply_fsdp2(model, {"mesh": mesh}, {})
    return model


def fusedhead_matches_unsharded(rank: int, world: int) -> None:
    """Per-rank outputs equal the unsharded model's; gathered gradients equal their rank mean."""
    from torch.distributed.fsdp import FSDPModule

    base = tiny_qwen2(0)
    batches = [packed_micro_batch(LENGTHS, seed=10 + r) for r in range(world)]
    expected = [scored(base, "fusedhead:torch", mb, ENTROPY_WEIGHT) for mb in batches]
    with restored_verl_patches(type(base)):
        model = _sharded("fusedhead:torch")
        assert isinstance(model.lm_head, FSDPModule), "apply_fsdp2 shards an untied lm_head alone"
        assert type(model.lm_head.weight).__name__ == "DTensor"
        log_probs, entropy = engine_log_probs(model, batches[rank])
        (log_probs.sum() + ENTROPY_WEIGHT * entropy.sum()).backward()
    assert_fp32_close(log_probs.detach(), expected[rank]["log_probs"], "log_probs")
    assert_fp32_close(entropy.detach(), expected[rank]["entropy"], "entropy")
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()  # FSDP2 reduce-scatters the mean over ranks
        mean = sum(e[f"grad:{name}"] for e in expected) / world
        assert_fp32_close(grad, mean, f"grad of {name}")
    print(f"rank {rank}: fusedhead under apply_fsdp2 matches the unsharded model", flush=True)


def verl_torch_path_reads_a_dtensor(rank: int, world: int) -> None:
    """verl's own fused torch path reads lm_head.weight in the root's forward: a DTensor there."""
    base = tiny_qwen2(0)
    with restored_verl_patches(type(base)):
        model = _sharded("torch")
        try:
            engine_log_probs(model, packed_micro_batch(LENGTHS, seed=10 + rank))
        except Exception as exc:  # what verl #5633 reports
            text = f"{type(exc).__name__}: {exc}"
            assert "DTensor" in text, text
            print(
                f"rank {rank}: verl's torch path failed as in verl #5633: {text[:200]}", flush=True
            )
            return
    raise AssertionError("verl's own fused torch path ran under apply_fsdp2 with an untied lm_head")


SCENARIOS = {
    "fusedhead_matches_unsharded": fusedhead_matches_unsharded,
    "verl_torch_path_reads_a_dtensor": verl_torch_path_reads_a_dtensor,
}


def worker(rank: int, world: int, init: str, scenarios: list[str], out_dir: str) -> None:
    """Run ``scenarios`` on this rank, logging to ``rank<N>.log``; re-raise the first failure."""
    log = open(Path(out_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 - kept open for the run
    sys.stdout = sys.stderr = log
    try:
        import verl  # noqa: F401  # loads the verl.plugins entry points, fusedhead's included

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        torch.manual_seed(0)
        for name in scenarios:
            SCENARIOS[name](rank, world)
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        log.flush()
    # Every scenario passed: leave without the interpreter's teardown, where a native destructor
    # can abort a rank after its group is gone (seen on CI in the FSDP2 worker).
    os._exit(0)
