"""causal_lm_logprobs on tiny random transformers models against the model's own logits.

Position t scores token t + 1; the last position and padding give 0; no ``[N, V]`` logits are
formed (the LM head's forward never runs). References are ``model(...).logits`` in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from integration_helpers import BACKEND, tiny_causal_lm

pytest.importorskip("transformers")

from fusedhead import FusedLMHead
from fusedhead.integrations.transformers import causal_lm_logprobs, shifted_labels

VOCAB = 503
CFG = {"backend": BACKEND}


def _batch(padding: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    if padding == "right":
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _reference(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    temperature: float | torch.Tensor = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_probs, entropy, valid) from ``model(...).logits`` in float64, written out by hand."""
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits.double()
    if isinstance(temperature, torch.Tensor):
        logits = logits / torch.broadcast_to(temperature.double(), ids.shape)[..., None]
    else:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    m = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    valid[:, :-1] = m[:, :-1] & m[:, 1:]
    pad = torch.zeros(ids.shape[0], 1, dtype=torch.float64)
    lp, ent = torch.cat([lp, pad], 1), torch.cat([ent, pad], 1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), valid


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)


def _logprobs(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The helper, with the LM head's forward made to fail: it must never form the logits."""
    head = model.get_output_embeddings()

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the helper ran the LM head's forward: that forms [N, V] logits")

    head.forward = refuse
    try:
        return causal_lm_logprobs(model, *args, **kwargs)
    finally:
        del head.forward


def test_shifted_labels_score_the_next_token_and_ignore_padding() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4], [1, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    assert shifted_labels(ids, mask).tolist() == [
        [6, 7, 8, -100],
        [-100, -100, 4, -100],
        [2, -100, -100, -100],
    ]
    assert shifted_labels(ids).tolist()[0] == [6, 7, 8, -100]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_matches_model_logits(kind: str, padding: str) -> None:
    model = tiny_causal_lm(kind)
    ids, mask = _batch(padding)
    mask_arg = None if padding == "none" else mask
    out = _logprobs(model, ids, mask_arg, temperature=0.8, config=CFG)
    with torch.no_grad():
        lp, ent, valid = _reference(model, ids, mask_arg, 0.8)
    assert out.log_probs.shape == ids.shape and out.log_probs.dtype == torch.float32
    _close(out.log_probs, lp)
    _close(out.entropy, ent)
    assert torch.all(out.log_probs[~valid] == 0) and torch.all(out.entropy[~valid] == 0)
    assert bool((out.log_probs[valid] < 0).all())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gradients_match_model_logits(kind: str) -> None:
    """Every parameter's gradient, against the logits path of a float64 copy of the model.

    Errors as docs/design.md measures them: relative L2 over the tensor and max abs error relative to
    the largest entry (fp32 rounding through two layers is about 1e-6 in both measures, for the
    fp32 logits path as for this one).
    """
    model = tiny_causal_lm(kind).train()
    model64 = copy.deepcopy(model).double()
    ids, mask = _batch("right")
    g = torch.Generator().manual_seed(7)
    adv, g_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    out = _logprobs(model, ids, mask, temperature=0.7, config=CFG)
    ((out.log_probs * adv).sum() + (out.entropy * g_ent).sum()).backward()
    lp, ent, _ = _reference(model64, ids, mask, 0.7)
    ((lp * adv.double()).sum() + (ent * g_ent.double()).sum()).backward()
    params64 = dict(model64.named_parameters())
    for name, param in model.named_parameters():
        got, want = param.grad.double(), params64[name].grad
        rel = float((got - want).norm() / want.norm())
        worst = float((got - want).abs().max() / want.abs().max())
        assert rel < 1e-5 and worst < 1e-5, f"{name}: relative error {rel:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("shape", ["per-token", "per-sample"])
def test_per_token_temperature(shape: str) -> None:
    model = tiny_causal_lm("llama")
    ids, mask = _batch("left")
    g = torch.Generator().manual_seed(3)
    size = ids.shape if shape == "per-token" else (ids.shape[0], 1)
    temperature = torch.rand(size, generator=g) + 0.4
    if shape == "per-token":
        temperature[mask == 0] = 0.0  # values at ignored positions are never used
        temperature[:, -1] = float("nan")
    out = _logprobs(model, ids, mask, temperature=temperature, config=CFG)
    safe = torch.where(temperature > 0, temperature, 1.0).nan_to_num(1.0)
    with torch.no_grad():
        lp, ent, _ = _reference(model, ids, mask, safe)
        flat, _, _ = _reference(model, ids, mask, 1.0)
    _close(out.log_probs, lp)
    _close(out.entropy, ent)
    assert (out.log_probs.double() - flat).abs().max() > 1e-2  # the temperature did change things


def test_temperature_of_the_wrong_shape_says_how_to_give_one_per_sample() -> None:
    model = tiny_causal_lm("llama")
    ids, mask = _batch("none")
    with pytest.raises(ValueError, match=r"per-sample temperature has shape \[B, 1\]"):
        _logprobs(model, ids, mask, temperature=torch.ones(3), config=CFG)
    with pytest.raises(ValueError, match="finite values > 0"):
        _logprobs(model, ids, mask, temperature=torch.zeros(3, 1), config=CFG)


def test_position_ids_are_passed_to_the_decoder() -> None:
    """verl passes explicit position_ids (cumsum(mask) - 1); here spaced ones RoPE cannot ignore."""
    model = tiny_causal_lm("qwen2")
    ids, mask = _batch("left")
    pos = ((mask.cumsum(-1) - 1).clamp(min=0) * 3).long()
    out = _logprobs(model, ids, mask, position_ids=pos, config=CFG)
    with torch.no_grad():
        lp, ent, _ = _reference(model, ids, mask, position_ids=pos)
        plain, _, _ = _reference(model, ids, mask)
    _close(out.log_probs, lp)
    _close(out.entropy, ent)
    assert (lp - plain).abs().max() > 1e-3


def test_pack_false_gives_the_same_numbers() -> None:
    model = tiny_causal_lm("llama")
    ids, mask = _batch("right")
    temperature = torch.full(ids.shape, 0.9)
    a = _logprobs(model, ids, mask, temperature=temperature, config=CFG)
    b = _logprobs(model, ids, mask, temperature=temperature, config=CFG, pack=False)
    torch.testing.assert_close(a.log_probs, b.log_probs)
    torch.testing.assert_close(a.entropy, b.entropy)


def test_gemma2_softcap_is_read_from_the_model_config() -> None:
    """Gemma-2 applies final_logit_softcapping to the logits; the helper does the same, then / T."""
    model = tiny_causal_lm("gemma2")
    assert model.config.final_logit_softcapping == 5.0
    ids, mask = _batch("right")
    out = _logprobs(model, ids, mask, temperature=0.6, config=CFG)
    with torch.no_grad():
        lp, ent, _ = _reference(model, ids, mask, 0.6)  # model(...).logits are softcapped
    _close(out.log_probs, lp)
    _close(out.entropy, ent)
    uncapped = _logprobs(model, ids, mask, temperature=0.6, config=CFG, softcap=1e6)
    assert (uncapped.log_probs.double() - lp).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["cohere", "granite"])
def test_a_models_logit_scale_is_applied_as_its_forward_applies_it(kind: str) -> None:
    """Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling: the
    helper ignored both (0.28 off in log-probs on a tiny Cohere), a silently wrong score."""
    model = tiny_causal_lm(kind)
    ids, mask = _batch("left")
    out = _logprobs(model, ids, mask, temperature=0.8, config=CFG)
    with torch.no_grad():
        lp, ent, _ = _reference(model, ids, mask, 0.8)  # model(...).logits are scaled
    _close(out.log_probs, lp)
    _close(out.entropy, ent)


def test_a_padded_vocabulary_the_model_drops_is_refused() -> None:
    model = tiny_causal_lm("llama")
    model.config.unpadded_vocab_size = 500
    ids, mask = _batch("none")
    with pytest.raises(ValueError, match=r"^model.config.unpadded_vocab_size=500 \(llama"):
        _logprobs(model, ids, mask, config=CFG)


def test_return_entropy_false_and_backend_from_config() -> None:
    model = tiny_causal_lm("llama")
    ids, mask = _batch("none")
    out = _logprobs(
        model, ids, mask, config={**CFG, "options": {"block_vocab": 64}}, return_entropy=False
    )
    assert out.entropy is None
    with torch.no_grad():
        lp, _, _ = _reference(model, ids, mask)
    _close(out.log_probs, lp)


def test_config_is_a_backend_name_as_every_other_integrations_head() -> None:
    """``config="torch"`` picks the backend by its name, as TRL's, verl's and OpenRLHF's glue
    take it (a str was refused: "config must be a FusedHeadConfig, a mapping, ..."); a misspelt
    name is an UnknownBackendError naming ``config`` and what is installed."""
    from fusedhead.errors import UnknownBackendError

    model = tiny_causal_lm("llama")
    ids, mask = _batch("none")
    out = causal_lm_logprobs(model, ids, mask, config="torch", return_entropy=False)
    with torch.no_grad():
        lp, _, _ = _reference(model, ids, mask)
    _close(out.log_probs, lp)
    with pytest.raises(UnknownBackendError, match=r"config='trch' names no installed") as info:
        causal_lm_logprobs(model, ids, mask, config="trch")
    assert "torch" in str(info.value)
    with pytest.raises(TypeError, match=r"config must be a FusedHead, .* got int 3"):
        causal_lm_logprobs(model, ids, mask, config=3)  # type: ignore[arg-type]


def test_a_model_whose_lm_head_is_a_fused_lm_head() -> None:
    """Replacing lm_head keeps generation-style calls working (logits) and the helper uses it."""
    model = tiny_causal_lm("qwen2")
    ids, mask = _batch("right")
    with torch.no_grad():
        want, _, _ = _reference(model, ids, mask, 0.9)
    model.lm_head = FusedLMHead.from_model(model, CFG)
    with torch.no_grad():
        again, _, _ = _reference(model, ids, mask, 0.9)  # model(...) calls lm_head(h): logits
    _close(again.float(), want)
    out = _logprobs(model, ids, mask, temperature=0.9)
    _close(out.log_probs, want)


def test_refuses_inputs_it_cannot_shift() -> None:
    model = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match=r"input_ids must have shape \[B, T\]"):
        _logprobs(model, torch.zeros(5, dtype=torch.long), config=CFG)
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        _logprobs(model, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4), config=CFG)


def test_resize_token_embeddings_of_a_tied_model_keeps_the_fused_head_working() -> None:
    """Before: transformers set ``lm_head.out_features`` after tying the resized weight and
    FusedLMHead's read-only property raised, leaving the embeddings resized and
    ``config.vocab_size`` not: the next forward failed."""
    model = tiny_causal_lm("llama", tie_word_embeddings=True)
    model.lm_head = FusedLMHead.from_model(model, CFG)
    model.resize_token_embeddings(VOCAB + 9, mean_resizing=False)
    assert isinstance(model.lm_head, FusedLMHead)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.out_features == model.config.vocab_size == VOCAB + 9
    ids = torch.randint(0, VOCAB + 9, (2, 7), generator=torch.Generator().manual_seed(3))
    out = causal_lm_logprobs(model, ids, config=CFG)
    with torch.no_grad():
        lp, _, _ = _reference(model, ids, None)
    _close(out.log_probs, lp)
    with pytest.raises(ValueError, match=r"FusedLMHead.out_features is the weight's size 512"):
        model.lm_head.out_features = 100
