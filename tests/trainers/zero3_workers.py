"""Ranks of the DeepSpeed ZeRO-3 tests (gloo, on the CPU): one backward through the fused head
and one through the model's own logits, the full gradients saved for the test to compare."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

STUBS = str(Path(__file__).parent / "openrlhf_stubs")


def tiny_qwen2_dirs(root: Path, vocab: int) -> list[str]:
    """An untied and a tied tiny Qwen2 saved under ``root``, their head weights of a few units."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dirs = []
    for tied in (False, True):
        cfg = Qwen2Config(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
            pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.3)
        path = root / f"tiny-qwen2-tied-{tied}"
        model.save_pretrained(path)
        dirs.append(str(path))
    return dirs


def free_port() -> int:
    """A TCP port free on this host now, for the rank's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts and right-padded responses, as OpenRLHF's experience maker has them."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, vocab, (3, 14), generator=g)
    mask = torch.ones_like(seq)
    mask[0, :3] = 0
    mask[1, 12:] = 0
    mask[2, 10:] = 0
    return seq.masked_fill(mask == 0, 0), mask, mask[:, -6:].clone()


def _backward(engine: Any, loss: torch.Tensor, log_probs: torch.Tensor) -> dict[str, Any]:
    """``loss``'s backward through ``engine``; the log-probs and the full (gathered) gradients of
    the head and the embeddings, the engine torn down."""
    from deepspeed.utils import safe_get_full_grad

    engine.backward(loss)
    grads = {
        name: safe_get_full_grad(p).clone()
        for name, p in engine.module.named_parameters()
        if name in ("lm_head.weight", "model.embed_tokens.weight")
    }
    engine.destroy()
    return {"log_probs": log_probs.detach().clone(), "grads": grads}


def _step(model_dir: str, patched: bool, vocab: int) -> dict[str, Any]:
    """One backward of a PPO-like loss (log-probs and an entropy bonus) under ZeRO-3."""
    import deepspeed
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
    return _backward(engine, -log_probs.sum() - 0.1 * (entropy * action_mask).sum(), log_probs)


def _start(rank: int, out: str, port: int) -> Any:
    """The rank's log and DeepSpeed's process group (gloo, one rank)."""
    log = open(Path(out) / f"rank{rank}.log", "w")  # noqa: SIM115 - the rank's whole life
    sys.stdout = sys.stderr = log
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="1",
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return log


def openrlhf_worker(rank: int, model_dirs: list[str], vocab: int, out: str, port: int) -> None:
    """Rank ``rank``: each model, OpenRLHF's own forward then the patched one."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        sys.path.insert(0, STUBS)  # OpenRLHF imports flash-attn's padding helpers only
    log = _start(rank, out, port)
    results = {
        d: {"theirs": _step(d, False, vocab), "ours": _step(d, True, vocab)} for d in model_dirs
    }
    torch.save(results, Path(out) / "results.pt")
    log.flush()


def _lm_head_step(model_dir: str, fused: bool, vocab: int) -> dict[str, Any]:
    """One backward of the next-token log-probs of a model partitioned by ZeRO-3:
    from its own logits, or from ``lm_head_logprobs`` on its decoder's hidden states (the path
    of the TRL, verl and transformers glue: the head's weight read inside the head's call)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from fusedhead.integrations.lm_head import lm_head_logprobs

    ds_config = {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids, mask, _ = _batch(vocab)
    labels = torch.roll(ids, -1, 1).masked_fill(mask == 0, -100)
    if fused:
        hidden = engine.module.model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = lm_head_logprobs(engine.module.lm_head, hidden, labels, head="torch")
        log_probs, entropy = out.log_probs, out.entropy
    else:
        logp = torch.log_softmax(engine(input_ids=ids, attention_mask=mask).logits.float(), -1)
        log_probs = logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1) * (labels != -100)
        entropy = -(logp.exp() * logp).sum(-1) * (labels != -100)
    return _backward(engine, -log_probs.sum() - 0.1 * entropy.sum(), log_probs)


def lm_head_worker(rank: int, model_dirs: list[str], vocab: int, out: str, port: int) -> None:
    """Rank ``rank``: each model, its own logits then ``lm_head_logprobs``."""
    log = _start(rank, out, port)
    results = {
        d: {"theirs": _lm_head_step(d, False, vocab), "ours": _lm_head_step(d, True, vocab)}
        for d in model_dirs
    }
    torch.save(results, Path(out) / "results.pt")
    log.flush()
