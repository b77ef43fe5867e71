"""TRL GRPO with fusedhead, offline on the CPU: two steps beside TRL's own fused LM head.

    .venv/bin/python examples/trainers/trl_grpo.py [--backend NAME] [--fused-policy-loss]

The backend is named in TRL's own config (``FusedHeadGRPOConfig(fused_head_backend=...)``); the
same two steps run with TRL's own kernel (``trl.GRPOConfig``) and the logged metrics
(``grad_norm`` included) are printed side by side. A tiny Llama and a word-level tokenizer are
built here (tiny.py), nothing is downloaded. About 20 s on two cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import WORDS, add_backend_flag, make_tokenizer, save_tiny_llama

#: The logged metrics compared; each difference is relative above magnitude 1 (grad_norm ~ 20).
KEYS = ("loss", "kl", "entropy", "reward", "clip_ratio/region_mean", "grad_norm")


def reward_len(completions: list[str], **_: Any) -> list[float]:
    """A toy reward that varies between completions, so the advantages are not all zero."""
    return [float(len(c.split()) % 5) for c in completions]


def run(
    model_dir: Path, out: Path, backend: str | None, fused_loss: bool = False
) -> list[dict[str, float]]:
    """Two GRPO steps; ``backend=None`` is TRL's own kernel (and loss). The logged lines.

    ``fused_loss``: both runs keep the KL unweighted (``use_bias_correction_kl=False``) and
    fusedhead's computes the loss with ``fused_policy_loss`` (``fused_policy_loss=True``)."""
    import trl
    from datasets import Dataset

    from fusedhead.integrations import trl as fh_trl

    common: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        # step 2 updates on step 1's generations again, and a tight clip range makes it clip
        num_iterations=2,
        epsilon=0.05,
        beta=0.1,
        learning_rate=0.02,
        optim="sgd",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )
    if fused_loss:
        common["use_bias_correction_kl"] = False
    if backend is None:
        args: Any = trl.GRPOConfig(**common)
        trainer_cls: Any = trl.GRPOTrainer
    else:
        # the backend by name, in TRL's config: this line is all a TRL user adds
        if fused_loss:  # the loss too, from TRL's config
            common["fused_policy_loss"] = True
        args = fh_trl.FusedHeadGRPOConfig(fused_head_backend=backend, **common)
        trainer_cls = fh_trl.FusedHeadGRPOTrainer
    prompts = [" ".join(WORDS[i : i + 3]) for i in range(0, 24, 3)]
    trainer = trainer_cls(
        model=str(model_dir),
        args=args,
        reward_funcs=reward_len,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=make_tokenizer(),  # the object, not a saved-and-reloaded copy
    )
    if backend is not None:
        print(f"fusedhead backend from TRL's config: {trainer.fused_head.name!r}")
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_flag(parser)
    parser.add_argument(
        "--fused-policy-loss",
        action="store_true",
        help="fusedhead's run computes GRPO's loss with fused_policy_loss (fused_policy_loss=True)",
    )
    opts = parser.parse_args()
    # fusedhead's INFO line says, once per LM head, that the loss runs inside the head
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("fusedhead").setLevel(logging.INFO)
    backend = opts.backend
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = save_tiny_llama(root, make_tokenizer())
        theirs = run(model_dir, root / "trl", None, opts.fused_policy_loss)
        ours = run(model_dir, root / "fusedhead", backend, opts.fused_policy_loss)
    print(f"\n{'step':>4}  {'metric':<24} {'TRL kernel':>14} {backend:>18} {'|diff|':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True), 1):
        for key in KEYS:
            if key in a and key in b:
                diff = abs(a[key] - b[key]) / max(1.0, abs(a[key]))
                worst = max(worst, diff)
                print(f"{step:>4}  {key:<24} {a[key]:>14.8f} {b[key]:>18.8f} {diff:>9.1e}")
    print(f"largest difference: {worst:.2e} (|diff|: relative above magnitude 1)")
    if worst > 1e-5:
        raise SystemExit(f"fusedhead and TRL's kernel disagree by {worst:.2e}")


if __name__ == "__main__":
    main()
