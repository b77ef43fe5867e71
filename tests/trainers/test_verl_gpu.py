"""verl's FSDP-engine feed on a CUDA GPU, bf16: ``fusedhead:triton`` beside verl's torch path.

A Qwen2-shaped model (V = 151936) scores 8192 packed tokens at temperature 0.7. Both paths see
the same bf16 hidden states (captured from the decoder); each one's log-probs and entropy are
compared with fp64 math on those hidden states and the bf16 weight. fusedhead accumulates in
fp32, verl's torch path rounds the logits to bf16 first, so fusedhead must be at least as close.
Time (second call, after compilation) and peak memory of forward + backward are printed for
both (``pytest -m gpu -s tests/trainers/test_verl_gpu.py``).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("verl", reason="verl is not installed (bash scripts/trainers/verl.sh)")

from verl_helpers import (  # noqa: E402
    apply_verl_monkey_patch,
    engine_log_probs,
    restored_verl_patches,
)

VOCAB = 151936
TEMPERATURE = 0.7


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)


def _batch() -> Any:
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    gen = torch.Generator().manual_seed(1)
    lengths = [1024] * 8
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    return tu.get_tensordict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.nested_tensor(
                [torch.arange(n) for n in lengths], layout=torch.jagged
            ),
        },
        non_tensor_dict={
            "temperature": TEMPERATURE,
            "use_remove_padding": True,
            "use_fused_kernels": True,
            "calculate_entropy": True,
            "pad_mode": DatasetPadMode.NO_PADDING,
        },
    ).to("cuda")


def _run(base: torch.nn.Module, backend: str, batch: Any) -> dict[str, Any]:
    model = copy.deepcopy(base)
    captured: dict[str, torch.Tensor] = {}
    model.model.register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("hidden", out[0].detach())
    )
    with restored_verl_patches(type(model)):
        apply_verl_monkey_patch(model, backend)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        log_probs, entropy = engine_log_probs(model, batch)
        (log_probs.float().sum() + 0.01 * entropy.float().sum()).backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {
        "log_probs": log_probs.detach().float(),
        "entropy": entropy.detach().float(),
        "hidden": captured["hidden"].squeeze(0),
        "weight": model.lm_head.weight.detach(),
        "labels": torch.roll(batch["input_ids"].values(), -1),
        "seconds": seconds,
        "peak_gib": (torch.cuda.max_memory_allocated() - before) / 2**30,
    }


def _fp64_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lps, ents = [], []
    w = weight.double()
    for rows in range(0, hidden.shape[0], 1024):
        logits = (hidden[rows : rows + 1024].double() @ w.T) / TEMPERATURE
        logp = logits.log_softmax(-1)
        lps.append(logp.gather(-1, labels[rows : rows + 1024, None]).squeeze(-1))
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def test_fusedhead_triton_beside_verls_torch_path_on_one_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible here")
    base = _model()
    batch = _batch()
    results = {}
    for backend in ("torch", "fusedhead:triton"):
        _run(base, backend, batch)  # warm-up: Triton compiles its kernels on the first call
        results[backend] = _run(base, backend, batch)
    errors = {}
    for backend, r in results.items():
        ref_lp, ref_ent = _fp64_reference(r["hidden"], r["weight"], r["labels"])
        errors[backend] = (
            float((r["log_probs"].double() - ref_lp).abs().max()),
            float((r["entropy"].double() - ref_ent).abs().max()),
        )
        print(
            f"{backend}: fwd+bwd {r['seconds'] * 1e3:.1f} ms, peak extra {r['peak_gib']:.2f} GiB, "
            f"max |log-prob err| {errors[backend][0]:.2e}, max |entropy err| {errors[backend][1]:.2e}"
        )
    ours, theirs = errors["fusedhead:triton"], errors["torch"]
    assert ours[0] <= theirs[0] and ours[1] <= theirs[1], errors
    assert ours[0] < 1e-3 and ours[1] < 1e-3, errors  # fp32 accumulation on bf16 inputs
