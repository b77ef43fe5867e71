"""``policy_loss.loss_mode: fusedhead`` on the models verl builds around the LM head differently.

verl 0.9.1's actor engine (``FSDPEngineWithLMHead``, FSDP2, one gloo rank), driven by
examples/trainers/verl_fused_policy_loss.py as in test_verl_actor_fused_loss.py, once as verl
ships it and once with the fused loss, on:

- a tied-embedding Qwen2 (``lm_head.weight`` is ``embed_tokens.weight``, as Qwen2.5-0.5B..3B,
  Qwen3's small models, Llama-3.2, Gemma): verl's ``apply_fsdp2`` leaves such a head to the root
  unit, which reshards after its forward (``reshard_after_forward: true``, verl's default), so the
  fused loss, run after the model's forward, must run inside the root's call; the tied weight's
  gradient is the head's and the embedding's summed;
- LoRA (``model.lora_rank > 0``): the engine's module is PEFT's ``PeftModel`` wrapping the model
  fusedhead's forward was given.

Every logged metric agrees to 6 decimals and the parameters after four SGD steps to
:data:`PARAM_ATOL`, as in test_verl_actor_fused_loss.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

import verl  # noqa: F401  (the verl.plugins entry points, fusedhead's among them)
from verl_helpers import fused_policy_loss_example

from fusedhead.integrations import verl_actor

#: SGD: a parameter differs by lr times the summed gradient difference (see
#: test_verl_actor_fused_loss.py, whose tolerances these are).
LR = 1e-2
SGD = {"optimizer": "SGD", "lr": LR, "weight_decay": 0.0}
PARAM_ATOL = 1e-6
SETTINGS = dict(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05)
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}


ex = fused_policy_loss_example()


@pytest.fixture(scope="module")
def models() -> Iterator[dict[bool, tuple[Path, int]]]:
    """The tiny Qwen2 on disk, untied and tied (by ``tie``), verl's platform as the CPU, one gloo
    rank; all undone after."""
    with tempfile.TemporaryDirectory() as tmp, ex.cpu_platform():
        started = not torch.distributed.is_initialized()
        try:
            yield {tie: ex.save_tiny_qwen2(Path(tmp), tie=tie) for tie in (False, True)}
        finally:
            if started and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _initial(path: Path) -> dict[str, torch.Tensor]:
    """The saved model's parameters (the tied weight once, under the embedding's name)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter of the FSDP2 engine (a DTensor) as a plain tensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _assert_same_training(model: tuple[Path, int], **options: Any) -> dict[str, torch.Tensor]:
    """Two ``update_actor`` steps with verl's loss and with the fused one: every logged metric
    and every parameter after them agree. The fused run's parameters are returned."""
    path, vocab = model
    torch.manual_seed(0)  # LoRA's adapters start random: the same start for both
    theirs, params_v = ex.train(path, vocab, fused=False, optim=SGD, **options, **SETTINGS)
    torch.manual_seed(0)
    ours, params_f = ex.train(path, vocab, fused=True, optim=SGD, **options, **SETTINGS)
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert set(a) == set(b), (step, sorted(set(a) ^ set(b)))
        for key, value in a.items():
            assert abs(b[key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key, b[key], value)
    assert params_v.keys() == params_f.keys()
    for name, p in params_v.items():
        torch.testing.assert_close(params_f[name], p, atol=PARAM_ATOL, rtol=0.0, msg=name)
    return params_f


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_tied_head_trains_as_verls_own(
    models: dict[bool, tuple[Path, int]], reshard_after_forward: bool
) -> None:
    """The tied weight lives in the root unit, resharded after the model's forward with verl's
    default: the fused loss runs inside the root's call, and the tied weight's update (head and
    embedding gradients summed, reduce-scattered into the sharded parameter) is verl's."""
    fsdp = {"reshard_after_forward": reshard_after_forward}
    params = _assert_same_training(models[True], fsdp_options=fsdp)
    assert "lm_head.weight" not in params  # the tie is kept: one parameter, the embedding's
    tied = "model.embed_tokens.weight"
    moved = float((_full(params[tied]) - _initial(models[True][0])[tied]).abs().max())
    assert moved > 1e3 * PARAM_ATOL, moved  # so agreeing to PARAM_ATOL is no accident


def test_the_fused_loss_runs_in_the_fsdp2_unit_that_holds_the_head_weight(
    models: dict[bool, tuple[Path, int]],
) -> None:
    """:func:`verl_actor.weight_owner` on verl's FSDP2 engine: ``lm_head`` where verl shards it
    on its own (untied), the root for a tied head (no unit of its own), ``lm_head`` without a
    root to look in."""
    from transformers import Qwen2ForCausalLM
    from transformers.integrations import flash_attention

    from fusedhead.integrations import verl as fh_verl

    forward, flash = Qwen2ForCausalLM.forward, flash_attention._flash_attention_forward
    fh_verl.fix_trl_value_head_probe()
    try:
        for tie, (path, _) in models.items():
            model, config = ex.actor_configs(path, fused=True)
            root = ex.build_actor(model, config).module
            owner = verl_actor.weight_owner(root, root.lm_head)
            assert owner is (root if tie else root.lm_head), (tie, type(owner).__name__)
            assert verl_actor.weight_owner(None, root.lm_head) is root.lm_head
    finally:
        fh_verl.fix_trl_value_head_probe(False)
        Qwen2ForCausalLM.forward = forward  # type: ignore[method-assign]
        flash_attention._flash_attention_forward = flash


@pytest.mark.parametrize("tie", [False, True])
def test_lora_trains_as_verls_own(models: dict[bool, tuple[Path, int]], tie: bool) -> None:
    """``lora_rank > 0``: the engine's module is PEFT's wrapper around the patched model; the
    fused loss sees through it (it was refused at the first micro-batch as if ``impl_backend``
    were not fusedhead's) and trains the adapters as verl's loss does."""
    pytest.importorskip("peft", reason="peft is not installed (verl's LoRA needs it)")
    params = _assert_same_training(models[tie], model_options=LORA)
    adapters = [name for name in params if "lora_B" in name]
    assert adapters, sorted(params)[:5]
    assert max(float(_full(params[name]).abs().max()) for name in adapters) > 1e3 * PARAM_ATOL


def test_the_patched_model_is_found_under_peft_and_fsdp1_wrappers() -> None:
    """``_check_engine`` looks for the model fusedhead's forward was given under
    ``PeftModel.get_base_model()`` and FSDP1's ``.module``; a wrapper around an unpatched model
    is still refused."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from verl_helpers import tiny_qwen2

    patched, plain = tiny_qwen2(), tiny_qwen2()
    verl_actor.patched_model(patched)
    lora = peft.LoraConfig(r=2, target_modules="all-linear")
    wrapped = peft.get_peft_model(patched, lora)
    assert verl_actor._patched_model_in(wrapped) is patched
    assert verl_actor._patched_model_in(patched) is patched

    class FullyShardedDataParallel(torch.nn.Module):  # FSDP1's wrapper, known by its name
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    assert verl_actor._patched_model_in(FullyShardedDataParallel(wrapped)) is patched
    assert verl_actor._patched_model_in(peft.get_peft_model(plain, lora)) is None
    assert verl_actor._patched_model_in(None) is None
