"""A tiny, offline GRPO run for the TRL tests: a random Llama saved locally, a made-up tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["[PAD]", "[EOS]", "[UNK]"]


#: Training arguments of the two-step CPU runs that compare a trainer with and without fusedhead:
#: sgd (updates proportional to gradients: both runs stay within fp32 rounding), fp32, one logged
#: line a step, nothing saved or reported.
CPU_STEPS: dict[str, Any] = dict(
    optim="sgd",
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    seed=0,
    bf16=False,
    fp16=False,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def make_tokenizer() -> Any:
    """A word-level fast tokenizer over a made-up vocabulary (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )


def make_model_dir(root: Path, *, seed: int = 0, **config: Any) -> Path:
    """A random causal LM (Llama, fp32, untied head) and its tokenizer, saved under ``root``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **config,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units (fp32 rounding of log-probs stays near 1e-7)
        model.lm_head.weight.normal_(0, 0.3)
    path = root / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reward_len(completions: list[str], **_: Any) -> list[float]:
    """A dummy reward that varies between completions (so advantages are not all zero)."""
    return [float(len(c.split()) % 5) for c in completions]


def record_fused_calls(model: nn.Module, tag: str, calls: list[tuple[str, torch.Tensor]]) -> None:
    """Append ``(tag, log_probs)`` of every ``fused_lm_head=True`` call of ``model``."""
    previous = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = previous(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            calls.append((tag, out.log_probs.detach().clone()))
        return out

    forward.previous = previous  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]


def build_trainer(
    model_dir: Path, out_dir: Path, *, backend: str | None, kind: str = "GRPO", **overrides: Any
) -> Any:
    """A GRPO (or RLOO) trainer for two steps, beta > 0; ``backend=None`` keeps TRL's kernel."""
    import trl
    from datasets import Dataset

    from fusedhead.integrations import trl as fh_trl

    prompts = [" ".join(WORDS[i : i + 3]) for i in range(0, 24, 3)]
    dataset = Dataset.from_dict({"prompt": prompts})
    common: dict[str, Any] = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        beta=0.1,
        learning_rate=0.02,
        **CPU_STEPS,
    )
    common.update(overrides)
    trainer_kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        reward_funcs=reward_len,
        train_dataset=dataset,
        processing_class=make_tokenizer(),
    )
    if backend is None:
        config, trainer_cls = getattr(trl, f"{kind}Config"), getattr(trl, f"{kind}Trainer")
        trainer: Any = trainer_cls(args=config(**common), **trainer_kwargs)
    else:
        config = getattr(fh_trl, f"FusedHead{kind}Config")
        args = config(fused_head_backend=backend, **common)
        trainer = getattr(fh_trl, f"FusedHead{kind}Trainer")(args=args, **trainer_kwargs)
    return trainer


def run_grpo(
    model_dir: Path, out_dir: Path, *, backend: str | None, kind: str = "GRPO"
) -> dict[str, Any]:
    """Two GRPO (or RLOO) steps; every fused call's log-probs and the logged metrics."""
    trainer = build_trainer(model_dir, out_dir, backend=backend, kind=kind)
    calls: list[tuple[str, torch.Tensor]] = []
    record_fused_calls(trainer.model, "policy", calls)
    assert trainer.ref_model is not None, "beta > 0 must build a reference model"
    record_fused_calls(trainer.ref_model, "ref", calls)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"calls": calls, "logs": logs, "trainer": trainer}
