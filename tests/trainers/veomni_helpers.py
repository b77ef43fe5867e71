"""Shared pieces of the VeOmni tests: a tiny Qwen2 built by VeOmni, its batches, comparisons.

``build_foundation_model`` installs the loss into transformers' process-wide ``LOSS_MAPPING``
and binds the OpSlots of VeOmni's (module-global) generated modeling code; :func:`veomni_state`
puts ``LOSS_MAPPING`` back afterwards so other tests' Hugging Face models keep their own loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 300
IGNORE = -100


@contextlib.contextmanager
def veomni_state() -> Iterator[None]:
    """fusedhead's VeOmni integration installed for the block; all global state restored."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    from fusedhead import refresh as clear_cache
    from fusedhead.integrations import veomni as fh_veomni

    saved = dict(LOSS_MAPPING)
    fh_veomni.install()
    try:
        yield
    finally:
        fh_veomni.uninstall()
        LOSS_MAPPING.clear()
        LOSS_MAPPING.update(saved)
        clear_cache()


def build(impl: str, state: dict[str, torch.Tensor] | None = None) -> Any:
    """A 2-layer Qwen2 from VeOmni's ``build_foundation_model`` with ``impl`` as its CE kernel.

    Parameters are seeded random values (or ``state``), so two builds are the same model.
    Every other op is VeOmni's eager one: this is the CPU.
    """
    from transformers import Qwen2Config
    from veomni.arguments.arguments_types import OpsImplementationConfig
    from veomni.models import build_foundation_model

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    ops = OpsImplementationConfig(
        attn_implementation="eager",
        cross_entropy_loss_implementation=impl,
        rms_norm_implementation="eager",
        swiglu_mlp_implementation="eager",
        rotary_pos_emb_implementation="eager",
        moe_implementation="eager",
        load_balancing_loss_implementation="eager",
    )
    model = build_foundation_model(
        config, torch_dtype="float32", init_device="cpu", ops_implementation=ops
    )
    with torch.no_grad():
        if state is None:
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        else:
            model.load_state_dict(state)
    return model


def packed_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """One packed row as VeOmni's PackingCollator makes it: positions restart per sequence and
    each sequence's first label is IGNORE; ``shift_labels`` are those labels shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = input_ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = IGNORE
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": labels,
        "shift_labels": shift_labels,
    }


def padded_batch(lengths: list[int], width: int, seed: int) -> dict[str, torch.Tensor]:
    """A right-padded ``[B, width]`` batch with its attention mask; padding labels are IGNORE."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    attention_mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def run(model: Any, batch: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
    """The loss (or log-probs and entropy with ``return_log_probs=True``) and every gradient."""
    out = model(**batch, **kwargs)
    result: dict[str, torch.Tensor] = {}
    if kwargs.get("return_log_probs"):
        aux = out.fused_linear_aux
        assert out.loss is None and aux is not None
        (aux.log_probs.sum() + 0.3 * aux.entropy.sum()).backward()
        result["log_probs"], result["entropy"] = aux.log_probs.detach(), aux.entropy.detach()
    else:
        assert out.loss is not None
        out.loss.backward()
        result["loss"] = out.loss.detach()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        result[f"grad:{name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return result


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """``|a - e| <= 1e-6 * max(1, |e|)`` elementwise (1e-6 relative above magnitude 1)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype == torch.float32, (what, actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).abs().max())
