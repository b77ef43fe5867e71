"""verl with fusedhead, offline on the CPU: the actor's packed log-probs beside verl's own kernel.

    .venv/bin/python examples/trainers/verl_fused_kernels.py [--backend NAME]

The backend is named in verl's own config (``actor_rollout_ref.model.fused_kernel_options.
impl_backend``). verl's own ``apply_monkey_patch`` patches a tiny Qwen2 (tiny.py) from that
config; a packed micro-batch goes through verl's FSDP engine feed and read-out
(``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs``, no Ray, no GPU),
once with fusedhead and once with verl's ``impl_backend: torch``; log-probs, entropy and the
gradients are printed side by side. With TRL 1.16 installed beside verl 0.9.1 it turns on
``fix_trl_value_head_probe`` (docs/integrations/verl.md). About 10 s on two cores.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import add_backend_flag, scaled_diff, tiny_model

VERL_CONFIG = """
actor_rollout_ref:
  model:
    use_remove_padding: true
    use_fused_kernels: true
    fused_kernel_options:
      impl_backend: {backend}
"""


def micro_batch(lengths: list[int], vocab: int, temperature: float) -> Any:
    """A no-padding micro-batch as verl's FSDP engine receives it (jagged ids and positions)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    return tu.get_tensordict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.nested_tensor(
                [torch.arange(n) for n in lengths], layout=torch.jagged
            ),
        },
        non_tensor_dict={
            "temperature": temperature,
            "use_remove_padding": True,
            "use_fused_kernels": True,
            "calculate_entropy": True,
            "pad_mode": DatasetPadMode.NO_PADDING,
        },
    )


def score(base: torch.nn.Module, model_cfg: Any, batch: Any) -> dict[str, torch.Tensor]:
    """Patch a copy of ``base`` as verl's engine does from ``model_cfg``; its outputs and grads."""
    from verl.models.transformers import monkey_patch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model = copy.deepcopy(base)
    forward = type(model).__dict__["forward"]
    try:
        monkey_patch.apply_monkey_patch(
            model=model,
            use_remove_padding=model_cfg.use_remove_padding,
            use_fused_kernels=model_cfg.use_fused_kernels,
            fused_kernels_backend=model_cfg.fused_kernel_options.impl_backend,
        )
        # verl's engine feed and read-out on one device (no sequence parallelism, no padding)
        engine = object.__new__(FSDPEngineWithLMHead)
        engine.pad_to_length, engine.use_ulysses_sp = False, False
        engine.ulysses_sequence_parallel_size = 1
        inputs, output_args = engine.prepare_model_inputs(batch)
        result = engine.prepare_model_outputs(model(**inputs), output_args, batch, None)
    finally:
        type(model).forward = forward  # verl patches the class; the next run patches it again
    log_probs, entropy = result["log_probs"].values(), result["entropy"].values()
    (log_probs.sum() + 0.3 * entropy.sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "gradients": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_flag(parser)
    backend = parser.parse_args().backend

    import verl  # noqa: F401  (loads the verl.plugins entry points, fusedhead's among them)
    from omegaconf import OmegaConf

    from fusedhead.integrations import verl as fh_verl

    if not fh_verl.trl_has_value_head():
        fh_verl.fix_trl_value_head_probe()  # verl 0.9.1 beside TRL >= 1.16 (or no TRL at all)
    ours_cfg = OmegaConf.create(VERL_CONFIG.format(backend=backend)).actor_rollout_ref.model
    verl_cfg = OmegaConf.create(VERL_CONFIG.format(backend="torch")).actor_rollout_ref.model
    base = tiny_model("qwen2", vocab_size=256, attn_implementation="sdpa")
    batch = micro_batch([7, 12, 5], vocab=256, temperature=0.7)
    ours = score(base, ours_cfg, batch)
    theirs = score(base, verl_cfg, batch)
    print(f"packed micro-batch: 3 sequences, {ours['log_probs'].numel()} tokens, T = 0.7")
    print(f"{'output':<10} {'verl impl_backend=torch':>24} {backend:>20} {'diff (1)':>11}")
    worst = 0.0
    for key in ("log_probs", "entropy", "gradients"):
        diff = scaled_diff(ours[key], theirs[key])
        worst = max(worst, diff)
        a, b = float(theirs[key].double().sum()), float(ours[key].double().sum())
        print(
            f"{key:<10} {'sum ' + format(a, '.7f'):>24} {'sum ' + format(b, '.7f'):>20} {diff:>11.1e}"
        )
    print("(1) max |diff| / max(1, max |verl's value|), checked against 1e-5")
    if worst > 1e-5:
        raise SystemExit(f"fusedhead and verl's own kernel disagree by {worst:.2e} (1)")


if __name__ == "__main__":
    main()
