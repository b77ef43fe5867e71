"""``fusedhead demo --model tiny-llama|tiny-qwen2|tiny-gemma2``: the transformers helper end to end.

Builds a small randomly initialised causal LM from a config (no download), scores a padded batch
with ``causal_lm_logprobs`` on the chosen backend, and checks log-probs, entropies and the LM-head
weight gradient against the model's own ``model(...).logits`` (log_softmax in float64).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Demo models: name -> (transformers config class, model class, extra config fields).
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "tiny-qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "tiny-gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 64, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    ),
}

#: Pass thresholds by dtype: (relative L2 error, max abs error) of log-probs, entropies, weight grad.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-2, 5e-2),
    torch.bfloat16: (2e-2, 2e-1),
}

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


class DemoUnavailable(RuntimeError):
    """The demo cannot run here (transformers missing, unknown model name)."""


def _check_name(name: object) -> None:
    """``name`` one of ``MODELS``, else ``DemoUnavailable`` naming the valid ones."""
    if not isinstance(name, str) or name not in MODELS:
        from fusedhead.checks import did_you_mean

        hint = did_you_mean(name, MODELS)
        raise DemoUnavailable(
            f"unknown demo model {name!r}{hint or ';'} choose one of {sorted(MODELS)}"
        )


def build_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A small random causal LM (hidden 256, 2 layers, vocab 32000) built from a config.

    The name is checked first: an unknown one is named with the valid ones whether or not
    transformers is installed (installing it would not make the name valid)."""
    _check_name(name)
    try:
        import transformers
    except ImportError as exc:
        from fusedhead.install_hints import extra_command

        raise DemoUnavailable(
            f"fusedhead demo --model needs transformers: {extra_command('transformers')}"
        ) from exc
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(seed)
    model: nn.Module = getattr(transformers, model_cls)(config)
    return model.to(dtype).eval()


def padded_batch(
    batch: int, seq: int, vocab: int, *, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids with right padding on odd rows and left padding on rows 2 mod 4."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        pad = int(torch.randint(1, seq // 2, (1,), generator=g))
        if b % 2 == 1:
            mask[b, seq - pad :] = 0
        elif b % 4 == 2:
            mask[b, :pad] = 0
    return input_ids.masked_fill(mask == 0, 0), mask


def reference_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` and entropies from full logits in float64; ignored positions 0."""
    z = logits.double()
    if isinstance(temperature, torch.Tensor):
        z = z / torch.broadcast_to(temperature.double(), labels.shape).unsqueeze(-1)
    else:
        z = z / temperature
    logp = torch.log_softmax(z, -1)
    valid = labels != ignore_index
    lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=z.dtype)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, max abs error) of ``a`` against ``b``."""
    a, b = a.double(), b.double()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-300))
    return rel, float((a - b).abs().max())


def _describe(temperature: float | torch.Tensor) -> str:
    if isinstance(temperature, torch.Tensor):
        return "per sample " + ", ".join(f"{t:g}" for t in temperature.flatten().tolist())
    return f"{temperature:g}"


def run(args: Any) -> int:
    """Run the demo for ``args.model``: 0 on PASS, 1 on FAIL, 2 when it cannot run here."""
    from fusedhead.api import FusedHead
    from fusedhead.config import FusedHeadConfig
    from fusedhead.integrations.transformers import causal_lm_logprobs, shifted_labels
    from fusedhead.options import load_json
    from fusedhead.registry import default_device

    try:  # before the backend is resolved: a wrong name is the first thing to say
        _check_name(args.model)
    except DemoUnavailable as exc:
        raise ValueError(f"demo --model {args.model}: {exc}") from None
    dtype = _DTYPES.get(str(getattr(args, "dtype", None) or "fp32"))
    if dtype is None:
        print(
            f"fusedhead demo --model: unknown dtype {args.dtype!r}; choose one of {sorted(_DTYPES)}"
        )
        return 2
    device = torch.device(getattr(args, "device", None) or default_device())
    options = load_json(args.options) if getattr(args, "options", None) else {}
    backend = getattr(args, "backend", None) or "torch"
    head = FusedHead(
        FusedHeadConfig.from_dict({"backend": backend, "options": options, "device": str(device)})
    )
    caps = head.capabilities(device)

    try:
        model: Any = build_model(args.model, dtype=dtype).to(device)
    except DemoUnavailable as exc:  # the command's one error line on stderr, exit 2
        raise ValueError(f"demo --model {args.model}: {exc}") from None
    vocab = model.config.vocab_size
    input_ids, mask = padded_batch(4, 128, vocab)
    input_ids, mask = input_ids.to(device), mask.to(device)
    temperature: float | torch.Tensor = 0.7
    if caps.per_token_temperature:
        temperature = torch.tensor([[1.0], [0.7], [0.9], [1.3]], device=device)
    labels = shifted_labels(input_ids, mask, ignore_index=head.config.ignore_index)
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(labels.shape, generator=g, dtype=torch.float64).to(device)
    weight = model.get_output_embeddings().weight

    softcap = getattr(model.config, "final_logit_softcapping", None)
    print(
        f"model {args.model}: {type(model).__name__}, hidden {model.config.hidden_size}, "
        f"vocab {vocab}, {dtype}, {device}; backend {backend!r} ({head.distribution or 'in-process'} "
        f"{head.version or ''}); batch {tuple(input_ids.shape)} with left and right padding; "
        f"temperature {_describe(temperature)}" + (f"; softcap {softcap}" if softcap else "")
    )

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        out = causal_lm_logprobs(model, input_ids, mask, temperature=temperature, config=head)
        assert out.entropy is not None
        torch.autograd.backward((out.log_probs.double() * advantages).sum())
        grad = weight.grad.detach().clone()  # type: ignore[union-attr]
        weight.grad = None
        return torch.stack([out.log_probs.detach(), out.entropy.detach()]), grad

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        lp, ent = reference_logprobs(logits, labels, temperature, head.config.ignore_index)
        torch.autograd.backward((lp * advantages).sum())
        grad = weight.grad.detach().clone()  # type: ignore[union-attr]
        weight.grad = None
        return torch.stack([lp.detach(), ent.detach()]), grad

    model.zero_grad(set_to_none=True)
    got, got_grad = fused()
    ref, ref_grad = reference()
    rel_tol, abs_tol = TOLERANCE[dtype]
    ok = True
    print("errors against log_softmax(model(...).logits) in float64, and of the lm_head gradient:")
    rows = [
        ("log_probs", got[0], ref[0]),
        ("entropy", got[1], ref[1]),
        ("lm_head grad", got_grad, ref_grad),
    ]
    for what, a, b in rows:
        rel, mx = errors(a.cpu(), b.cpu())
        passed = rel <= rel_tol and mx <= abs_tol * max(1.0, float(b.abs().max()))
        ok &= passed
        print(
            f"  {what:<13} rel err {rel:.2e}  max abs err {mx:.2e}  {'ok' if passed else 'TOO LARGE'}"
        )
    scored = int((labels != head.config.ignore_index).sum())
    print(f"{scored} of {labels.numel()} positions scored (last and padding positions give 0)")
    print(
        f"{'PASS' if ok else 'FAIL'} (tolerance for {dtype}: rel {rel_tol:g}, max abs {abs_tol:g})"
    )
    return 0 if ok else 1
