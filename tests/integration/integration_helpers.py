"""Helpers shared by the integration tests: float64 references written out, tiny HF models."""

from __future__ import annotations

from typing import Any

import pytest
import torch

BACKEND = "torch"


def full_logits_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies written out from full float64 logits, independently of fusedhead."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = (
        temperature.double().expand(labels.shape).unsqueeze(-1)
        if isinstance(temperature, torch.Tensor)
        else temperature
    )
    logp = torch.log_softmax(z / t, dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def assert_close64(
    got: torch.Tensor, want: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-5
) -> None:
    """fp32 results against float64 references."""
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def tiny_causal_lm(kind: str, *, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """A small random transformers causal LM built from a config (no download), fp32, eval mode."""
    transformers = pytest.importorskip("transformers")
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "cohere": ("CohereConfig", "CohereForCausalLM"),  # logits * logit_scale
        "granite": ("GraniteConfig", "GraniteForCausalLM"),  # logits / logits_scaling
    }
    config_cls, model_cls = classes[kind]
    fields: dict[str, Any] = dict(
        vocab_size=503,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "gemma2":
        fields.update(head_dim=16, final_logit_softcapping=5.0, attn_logit_softcapping=50.0)
    if kind == "cohere":
        fields.update(logit_scale=0.25, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if kind == "granite":
        fields.update(logits_scaling=4.0)
    fields.update(extra)
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**fields)
    model = getattr(transformers, model_cls)(config).eval()
    # Larger logits than the default init gives, so softcap and temperature change the result.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model
