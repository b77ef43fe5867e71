"""verl's actor with the fused policy loss from its config, offline on the CPU, beside verl's own.

    .venv/bin/python examples/trainers/verl_fused_policy_loss.py [--backend NAME]

verl 0.9.1's actor engine (``FSDPEngineWithLMHead``, FSDP2 on one gloo rank) is built from
verl's own config dataclasses twice on a tiny Qwen2 (tiny.py): once as verl ships it
(``policy_loss.loss_mode: vanilla``, full logits), once with the three settings that switch to
fusedhead's fused loss::

    actor_rollout_ref:
      model:
        use_fused_kernels: true
        fused_kernel_options: {impl_backend: fusedhead:torch}
      actor:
        policy_loss: {loss_mode: fusedhead}

Each runs two actor updates (verl's ``update_actor`` loop: mini-batches, micro-batches, packed
``use_remove_padding`` micro-batches, the optimizer step) on the same rollout batches and prints
every logged metric side by side. verl's FSDP engine is CUDA/NPU-only; :func:`cpu_platform`
registers a CPU platform through verl's own platform registry (``set_platform``) and picks the
engine with ``VERL_ENGINE_DEVICE=cuda`` (verl's override). About 15 s on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import add_backend_flag, make_tokenizer, tiny_model

#: Sequences per rollout batch, prompt and response widths (left/right padded, as verl's rollout).
BATCH, PROMPT, RESPONSE = 8, 6, 8


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


@contextlib.contextmanager
def cpu_platform() -> Iterator[None]:
    """verl's platform as the CPU (verl's ``set_platform``); verl's previous platform after."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    memory = types.SimpleNamespace(
        mem_get_info=lambda *a: (0, 0),
        memory_allocated=_zero,
        memory_reserved=_zero,
        max_memory_allocated=_zero,
        max_memory_reserved=_zero,
        reset_peak_memory_stats=_noop,
        empty_cache=_noop,
        synchronize=_noop,
        current_device=lambda: "cpu",
        is_available=lambda: False,
        manual_seed=_noop,
        manual_seed_all=_noop,
    )

    class PlatformCPU(PlatformCUDA):  # type: ignore[misc]
        """verl's CUDA platform with the device calls on the CPU."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return memory

        def current_device(self) -> Any:
            return "cpu"

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

    before = platform_manager._current_platform
    env = os.environ.get("VERL_ENGINE_DEVICE")
    platform_manager.set_platform(PlatformCPU())
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the FSDP engine registers for cuda/npu only
    try:
        yield
    finally:
        platform_manager._current_platform = before
        if env is None:
            os.environ.pop("VERL_ENGINE_DEVICE", None)
        else:
            os.environ["VERL_ENGINE_DEVICE"] = env


def save_tiny_qwen2(root: Path, *, tie: bool = False) -> tuple[Path, int]:
    """A tiny Qwen2 and its tokenizer saved under ``root`` (verl loads the model by path).

    ``tie``: the LM head's weight is the input embeddings' (``tie_word_embeddings``, as in
    Qwen2.5-0.5B..3B, Qwen3's small models, Llama-3.2, Gemma), so verl's FSDP2 root unit holds
    it instead of an ``lm_head`` unit of its own."""
    tokenizer = make_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tokenizer), attn_implementation="sdpa")
    if tie:
        model.config.tie_word_embeddings = True
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(model.lm_head.weight)
        model.lm_head.weight = model.model.embed_tokens.weight
    path = root / ("tiny-qwen2-tied" if tie else "tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, len(tokenizer)


def actor_configs(
    model_path: Path,
    *,
    fused: bool,
    backend: str = "fusedhead:torch",
    model_options: dict[str, Any] | None = None,
    fsdp_options: dict[str, Any] | None = None,
    **actor: Any,
) -> tuple[Any, Any]:
    """verl's ``(HFModelConfig, FSDPActorConfig)`` as hydra builds them from the YAML above.

    ``fused``: the three settings of the fused loss; else verl's defaults. ``actor`` overrides
    ``actor_rollout_ref.actor`` fields (``loss_agg_mode``, ``entropy_coeff``, ``use_kl_loss``...),
    ``model_options`` ``actor_rollout_ref.model`` ones (``lora_rank``, ``lora_alpha``...) and
    ``fsdp_options`` ``actor_rollout_ref.actor.fsdp_config`` ones (``reshard_after_forward``...).
    """
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        PolicyLossConfig,
    )

    model = HFModelConfig(
        path=str(model_path),
        use_remove_padding=True,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "sdpa"},
        use_fused_kernels=fused,
        fused_kernel_options={"impl_backend": backend} if fused else {},
        **(model_options or {}),
    )
    optim = actor.pop("optim", {"lr": 1e-3})
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    config = FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        use_remove_padding=True,
        rollout_n=1,
        use_torch_compile=False,
        fsdp_config=FSDPEngineConfig(
            model_dtype="fp32",
            mixed_precision=fp32,
            use_torch_compile=False,
            **(fsdp_options or {}),
        ),
        optim=FSDPOptimizerConfig(**optim),
        policy_loss=PolicyLossConfig(loss_mode="fusedhead" if fused else "vanilla"),
        **actor,
    )
    config.model_config = model
    return model, config


def build_actor(model: Any, config: Any) -> Any:
    """verl's actor engine as ``TrainingWorker`` builds it from the two configs (one rank)."""
    from verl.workers.engine import EngineRegistry

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0"
        )
    engine_config = config.engine
    engine_config.use_dynamic_bsz = False
    engine_config.micro_batch_size_per_gpu = config.ppo_micro_batch_size_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = config.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model.use_remove_padding
    engine_config.use_fused_kernels = model.use_fused_kernels
    model.model_type = "language_model"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model,
        engine_config=engine_config,
        optimizer_config=config.optim,
        checkpoint_config=config.checkpoint,
    )
    engine.initialize()
    return engine


def rollout_batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    """A rollout batch in verl's padded layout: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(100 + step)
    prompts = torch.randint(3, vocab, (BATCH, PROMPT), generator=g)
    responses = torch.randint(3, vocab, (BATCH, RESPONSE), generator=g)
    prompt_len = torch.randint(2, PROMPT + 1, (BATCH,), generator=g)
    response_len = torch.randint(1, RESPONSE + 1, (BATCH,), generator=g)
    response_len[0] = RESPONSE
    cols = torch.arange(PROMPT + RESPONSE)
    attention = (cols >= PROMPT - prompt_len[:, None]) & (cols < PROMPT + response_len[:, None])
    response_mask = attention[:, PROMPT:].long()
    response_mask[1, 0] = 0  # a masked token inside a response (a tool output in multi-turn)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention.long(),
        "position_ids": (attention.long().cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "advantages": torch.randn(BATCH, 1, generator=g).expand(BATCH, RESPONSE).contiguous(),
        "noise": 0.3 * torch.randn(3, BATCH, RESPONSE, generator=g),
    }


def _no_padding(batch: dict[str, torch.Tensor], **extra: torch.Tensor) -> Any:
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    fields = {k: v for k, v in batch.items() if k != "noise"} | extra
    return left_right_2_no_padding(TensorDict(fields, batch_size=[BATCH]))


def _flags(data: Any, config: Any, **extra: Any) -> Any:
    """The non-tensor flags verl's trainer and ``TrainingWorker`` put on an actor batch."""
    from verl.utils import tensordict_utils as tu

    model = config.model_config
    tu.assign_non_tensor(
        data,
        temperature=0.7,
        use_remove_padding=model.use_remove_padding,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=config.ppo_max_token_len_per_gpu,
        micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
        use_fused_kernels=model.use_fused_kernels,
        **extra,
    )
    return data


def old_log_probs(engine: Any, config: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The actor's ``compute_log_prob`` (forward only), padded to the responses ``[B, R]``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    data = _flags(_no_padding(batch), config, calculate_entropy=False, compute_loss=False)
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(tu.get(out["model_output"], "log_probs"), data).float()


def update_actor(
    engine: Any,
    config: Any,
    batch: dict[str, torch.Tensor],
    old: torch.Tensor,
    *,
    is_weights: bool = False,
) -> dict[str, float]:
    """verl's ``update_actor`` on one rollout batch: ``TrainingWorker.train_mini_batch`` /
    ``train_batch`` with the loss verl builds from the config (``partial(ppo_loss, config=)``),
    metrics reduced as verl's trainer logs them (``reduce_metrics``). ``is_weights``: rollout
    correction weights (``rollout_is_weights``, truncated at 2) in the batch."""
    from functools import partial

    import numpy as np
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import Metric
    from verl.workers.utils.losses import ppo_loss

    noise = batch["noise"]
    extra = {"old_log_probs": old + noise[0], "ref_log_prob": old + noise[1]}
    if is_weights:
        extra["rollout_is_weights"] = noise[2].exp().clamp(max=2.0)
    data = _flags(
        _no_padding(batch, **extra),
        config,
        calculate_entropy=config.calculate_entropy or config.entropy_coeff != 0.0,
        global_batch_size=config.ppo_mini_batch_size * config.rollout_n,
        compute_loss=True,
    )
    loss_fn = partial(ppo_loss, config=config)  # as ActorRolloutRefWorker.init_model builds it
    logged: dict[str, list[float]] = {}
    for mini in tu.make_iterator(
        data, mini_batch_size=config.ppo_mini_batch_size, epochs=1, seed=42,
        dataloader_kwargs={"shuffle": False},
    ):  # fmt: skip
        with engine.train_mode():
            out = engine.train_batch(mini, loss_function=loss_fn)
        metrics = dict(out["metrics"])
        metrics["loss"] = float(np.sum(out["loss"]))
        metrics["grad_norm"] = float(metrics["grad_norm"])
        for key, value in metrics.items():
            if isinstance(value, Metric):
                value = value.aggregate()
            elif isinstance(value, list):
                value = np.mean(value)
            logged.setdefault(key, []).append(float(value))
    return {key: float(np.mean(values)) for key, values in logged.items()}


def train(
    model_path: Path,
    vocab: int,
    *,
    fused: bool,
    steps: int = 2,
    is_weights: bool = False,
    **actor: Any,
) -> Any:
    """``steps`` actor updates; ``(metrics per step, parameters after)``."""
    from transformers import Qwen2ForCausalLM
    from transformers.integrations import flash_attention

    from fusedhead.integrations import verl as fh_verl

    fh_verl.fix_trl_value_head_probe()  # verl 0.9.1 beside TRL >= 1.16 (docs/integrations/verl.md)
    model, config = actor_configs(model_path, fused=fused, **actor)
    # verl's apply_monkey_patch patches the class's forward and transformers' flash attention
    forward, flash = Qwen2ForCausalLM.forward, flash_attention._flash_attention_forward
    try:
        engine = build_actor(model, config)
        per_step = []
        for step in range(steps):
            batch = rollout_batch(step, vocab)
            old = old_log_probs(engine, config, batch)
            per_step.append(update_actor(engine, config, batch, old, is_weights=is_weights))
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        fh_verl.fix_trl_value_head_probe(False)
        Qwen2ForCausalLM.forward = forward  # type: ignore[method-assign]
        flash_attention._flash_attention_forward = flash
    return per_step, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_flag(parser)
    backend = parser.parse_args().backend
    # fusedhead's INFO line says, once per LM head, that the loss runs inside the head
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("fusedhead").setLevel(logging.INFO)

    import verl  # noqa: F401  (loads the verl.plugins entry points, fusedhead's among them)

    torch.manual_seed(0)
    settings = dict(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
                    kl_loss_coef=0.05, clip_ratio_c=2.0)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, cpu_platform():
        path, vocab = save_tiny_qwen2(Path(tmp))
        theirs, _ = train(path, vocab, fused=False, **settings)
        ours, _ = train(path, vocab, fused=True, backend=backend, **settings)
    print(f"verl actor, 2 updates x 2 mini-batches x 2 packed micro-batches; {settings}")
    print(f"{'step':>4} {'metric':<24} {'loss_mode=vanilla':>18} {backend:>18} {'diff (1)':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if set(a) != set(b):
            raise SystemExit(f"logged metrics differ: {sorted(set(a) ^ set(b))}")
        for key in sorted(a):
            diff = abs(a[key] - b[key]) / max(1.0, abs(a[key]))
            worst = max(worst, diff)
            print(f"{step:>4} {key:<24} {a[key]:>18.7f} {b[key]:>18.7f} {diff:>9.1e}")
    print("(1) |diff| / max(1, |verl's value|), checked against 1e-6")
    if worst > 1e-6:
        raise SystemExit(f"the fused loss and verl's own differ by {worst:.2e} (1)")


if __name__ == "__main__":
    main()
