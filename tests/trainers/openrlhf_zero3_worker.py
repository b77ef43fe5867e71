"""A rank of the OpenRLHF ZeRO-3 test: the same actor, patched and not, trained one backward
under DeepSpeed ZeRO-3 (gloo), its full gradients saved for the test to compare."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

STUBS = str(Path(__file__).parent / "openrlhf_stubs")


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts and right-padded responses, as OpenRLHF's experience maker has them."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, vocab, (3, 14), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :3] = 0
    mask[1, 12:] = 0
    mask[2, 10:] = 0
    return seq.masked_fill(mask == 0, 0), mask, mask[:, -6:].clone()


def _step(model_dir: str, patched: bool, vocab: int) -> dict[str, Any]:
    """One backward of a PPO-like loss (log-probs and an entropy bonus) under ZeRO-3."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from openrlhf.models.actor import Actor

    from fusedhead.integrations.openrlhf import patch_actor

    ds_config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    actor = Actor(
        model_dir, attn_implementation="eager", param_dtype="bf16", ds_config=ds_config,
        temperature=0.7,
    ).float()  # fmt: skip
    optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=actor.model, optimizer=optimizer, config=ds_config)
    actor.model = engine  # as OpenRLHF's strategy.prepare leaves it
    if patched:
        patch_actor(actor, "torch")
    seq, mask, action_mask = _batch(vocab)
    log_probs, out = actor(
        seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True
    )
    entropy = out.entropy[:, -action_mask.shape[1] :]
    engine.backward(-log_probs.sum() - 0.1 * (entropy * action_mask).sum())
    grads = {
        name: safe_get_full_grad(p).clone()
        for name, p in engine.module.named_parameters()
        if name in ("lm_head.weight", "model.embed_tokens.weight")
    }
    engine.destroy()
    return {"log_probs": log_probs.detach().clone(), "grads": grads}


def worker(rank: int, model_dirs: list[str], vocab: int, out: str, port: int) -> None:
    """Rank ``rank``: each model, OpenRLHF's own forward then the patched one."""
    log = open(Path(out) / f"rank{rank}.log", "w")  # noqa: SIM115 - the rank's whole life
    sys.stdout = sys.stderr = log
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="1",
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        sys.path.insert(0, STUBS)  # OpenRLHF imports flash-attn's padding helpers only
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = {
        d: {"theirs": _step(d, False, vocab), "ours": _step(d, True, vocab)} for d in model_dirs
    }
    torch.save(results, Path(out) / "results.pt")
    log.flush()
