"""Shared pieces of the verl tests: a tiny causal LM, a packed micro-batch, verl's engine feed.

The micro-batch is what verl's FSDP engine receives (a TensorDict of jagged ``input_ids`` and
``position_ids`` plus its non-tensor flags); :func:`engine_log_probs` runs it through verl's own
``FSDPEngineWithLMHead.prepare_model_inputs`` and ``prepare_model_outputs``, so the model sees
exactly the packed ``[1, total]`` inputs and ``shift_labels`` (``input_ids_rmpad_rolled``) that
training would feed it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 300
HIDDEN = 32


def tiny_qwen2(seed: int = 0, *, tie: bool = False) -> nn.Module:
    """A random 2-layer Qwen2 causal LM in fp32 (untied head unless ``tie``), no download."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).float()


def packed_micro_batch(
    lengths: list[int], *, seed: int, temperature: float = 0.7, entropy: bool = True
) -> Any:
    """A no-padding micro-batch as verl's FSDP engine gets it (jagged ids and positions)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    input_ids = torch.nested.nested_tensor(ids, layout=torch.jagged)
    position_ids = torch.nested.nested_tensor(
        [torch.arange(n) for n in lengths], layout=torch.jagged
    )
    return tu.get_tensordict(
        {"input_ids": input_ids, "position_ids": position_ids},
        non_tensor_dict={
            "temperature": temperature,
            "use_remove_padding": True,
            "use_fused_kernels": True,
            "calculate_entropy": entropy,
            "pad_mode": DatasetPadMode.NO_PADDING,
        },
    )


def engine() -> Any:
    """verl's ``FSDPEngineWithLMHead`` with only what its input/output preparation reads.

    No sequence parallelism and no static padding: the single-device settings of the engine.
    """
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    eng = object.__new__(FSDPEngineWithLMHead)
    eng.pad_to_length = False
    eng.use_ulysses_sp = False
    eng.ulysses_sequence_parallel_size = 1
    return eng


def engine_log_probs(model: nn.Module, micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy)`` of the packed tokens, through verl's engine feed and read-out."""
    eng = engine()
    inputs, output_args = eng.prepare_model_inputs(micro_batch)
    assert inputs["shift_labels"].shape == inputs["input_ids"].shape  # the packed [1, total]
    output = model(**inputs)
    result = eng.prepare_model_outputs(output, output_args, micro_batch, None)
    return result["log_probs"].values(), result["entropy"].values()


def apply_verl_monkey_patch(model: nn.Module, backend: str) -> None:
    """verl's own ``apply_monkey_patch`` as its FSDP engine calls it (remove-padding, fused)."""
    from verl.models.transformers import monkey_patch

    monkey_patch.apply_monkey_patch(
        model=model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=backend
    )


@contextlib.contextmanager
def restored_verl_patches(model_cls: type) -> Iterator[None]:
    """Undo what verl's ``apply_monkey_patch`` changes process-wide, after the block.

    It swaps the model class's ``forward`` and transformers' flash-attention function. With TRL
    1.16 installed its probe for TRL's value-head model fails, so the block runs with fusedhead's
    opt-in fix on (``fix_trl_value_head_probe``, what a verl user beside TRL turns on).
    """
    from transformers.integrations import flash_attention

    from fusedhead.integrations import verl as fh_verl

    forward = model_cls.__dict__["forward"]
    fa = flash_attention._flash_attention_forward
    fh_verl.fix_trl_value_head_probe()
    try:
        yield
    finally:
        model_cls.forward = forward
        flash_attention._flash_attention_forward = fa
        fh_verl.fix_trl_value_head_probe(False)


def scored(
    base: nn.Module, backend: str, micro_batch: Any, entropy_weight: float = 0.3
) -> dict[str, torch.Tensor]:
    """Log-probs, entropy and every parameter's gradient of a copy of ``base`` patched by verl.

    The loss is ``sum(log_probs) + entropy_weight * sum(entropy)``, so both outputs' gradients
    reach every parameter.
    """
    model = copy.deepcopy(base)
    with restored_verl_patches(type(model)):
        apply_verl_monkey_patch(model, backend)
        log_probs, entropy = engine_log_probs(model, micro_batch)
        (log_probs.sum() + entropy_weight * entropy.sum()).backward()
    out = {"log_probs": log_probs.detach(), "entropy": entropy.detach()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[f"grad:{name}"] = p.grad.detach().clone()
    return out


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """``|a - e| <= 1e-6 * max(1, |e|)`` elementwise; returns the largest absolute difference.

    1e-6 is about 8 fp32 ulps at magnitude 1; for larger values (log-probs near -log V, summed
    gradients) it is the same 1e-6 relative to the value, the most two fp32 algorithms that
    round differently can promise.
    """
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype == torch.float32, (what, actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).abs().max())


def assert_body_grad_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """A model body's parameter gradient: ``|a - e| <= 1e-6 * max(1, max |e|)`` elementwise.

    Such a gradient is a sum over every token and layer the head's gradient flows back through,
    so two heads that agree to an ulp (the head's own outputs and gradient, held to
    ``assert_fp32_close``) give elements that differ by fp32 rounding of the summands, not of
    the element: where terms cancel, an element of 0.08 in a tensor of 5 differs by 2e-6 (an
    embedding gradient of the packed batch, transformers 5.22.2). 1e-6 of the tensor's own scale.
    """
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype == torch.float32, (what, actual.dtype, expected.dtype)
    atol = 1e-6 * max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).abs().max())


#: The trainers' examples (``examples/trainers``).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trainers"


def fused_policy_loss_example() -> Any:
    """``examples/trainers/verl_fused_policy_loss.py`` as a module (its folder on ``sys.path``,
    for its ``tiny`` import): its engine builders drive verl's actor in the tests."""
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(
        "verl_fused_policy_loss", EXAMPLES / "verl_fused_policy_loss.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
