"""``model_logit_transform``: the logit transform of a Hugging Face model, decided by its type.

Each transform kind is checked on a tiny random transformers model of that type: log-probs fused
from the decoder's last hidden state with the ``(logit_scale, softcap)`` it returns must equal the
log-softmax of the model's own ``model(input_ids).logits``. Before, the transform was guessed from
attribute names: xLSTM's ``output_logit_soft_cap`` was dropped, MPT's ``logit_scale`` (which
transformers' MPT never applies) was applied and its ``'inv_sqrt_d_model'`` crashed in
``float()``, and MiniCPM3's scale of the hidden states was applied again by a caller that stands
in for the LM head's forward (whose input already holds it). What fusedhead does not reproduce is
refused, naming the attribute.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

import fusedhead
from fusedhead.integrations import logit_transforms
from fusedhead.integrations.lm_head import lm_head_logprobs
from fusedhead.integrations.logit_transforms import MODEL_LOGIT_TRANSFORMS, model_logit_transform

transformers = pytest.importorskip("transformers")

V = 40  # vocabulary of every tiny model
ATOL = 1e-5  # float32 model logits against fused float32 log-probs of the same hidden states

#: The fields of a tiny Llama-style decoder (width 16, 2 layers).
TEXT: dict[str, Any] = dict(
    vocab_size=V,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=32,
)
VISION: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
)


@pytest.fixture(autouse=True)
def _fresh_heads() -> Iterator[None]:
    fusedhead.refresh()
    yield
    fusedhead.refresh()


def _tiny(config_cls: str, model_cls: str, **fields: Any) -> Any:
    """A random fp32 model of transformers' ``model_cls`` built from ``config_cls(**fields)``, in
    eval mode, its LM head scaled up so that a softcap or a scale moves the log-probs a lot."""
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)(**fields)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids ``[2, 8]`` and the labels they shift to (the last position ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (2, 8), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _own_log_probs(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probs of the labels under the model's own logits (float64 log-softmax), 0 if ignored."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits.double(), dim=-1)
    got = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return got.masked_fill(labels == -100, 0.0)


def _fused(
    model: Any,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    transform: tuple[float, float | None],
) -> torch.Tensor:
    """Fused log-probs of ``hidden`` through the model's LM head under ``transform``."""
    scale, softcap = transform
    with torch.no_grad():
        out = lm_head_logprobs(
            model.get_output_embeddings(),
            hidden,
            labels,
            head="torch",
            logit_scale=scale,
            softcap=softcap,
            return_entropy=False,
        )
    return out.log_probs.double()


def _decoder_hidden(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden state, as verl, TRL and ``causal_lm_logprobs`` take it."""
    with torch.no_grad():
        out = model.base_model(input_ids=ids)
    hidden: torch.Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def _check_matches(model: Any, expected: tuple[float, float | None]) -> None:
    """The transform read from the model's config is ``expected``, and the log-probs fused with it
    are the model's own; fused without it they are not (the transform matters here)."""
    transform = model_logit_transform(model.config)
    assert transform == pytest.approx(expected)
    ids, labels = _batch()
    hidden = _decoder_hidden(model, ids)
    want = _own_log_probs(model, ids, labels)
    torch.testing.assert_close(_fused(model, hidden, labels, transform), want, rtol=0, atol=ATOL)
    if transform != (1.0, None):
        plain = _fused(model, hidden, labels, (1.0, None))
        assert float((plain - want).abs().max()) > 1e-2


MODELS: dict[str, tuple[Callable[[], Any], tuple[float, float | None]]] = {
    # logits * logit_scale
    "cohere": (
        lambda: _tiny("CohereConfig", "CohereForCausalLM", **TEXT, logit_scale=0.25),
        (0.25, None),
    ),
    # logits / logits_scaling
    "granite": (
        lambda: _tiny("GraniteConfig", "GraniteForCausalLM", **TEXT, logits_scaling=4.0),
        (0.25, None),
    ),
    # logits * logits_scaling
    "hyperclovax": (
        lambda: _tiny("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", **TEXT, logits_scaling=0.5),
        (0.5, None),
    ),
    # logits * lm_head_multiplier
    "falcon_h1": (
        lambda: _tiny(
            "FalconH1Config",
            "FalconH1ForCausalLM",
            **TEXT,
            mamba_d_ssm=16,
            mamba_n_heads=4,
            mamba_d_head=4,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=4,
            lm_head_multiplier=0.25,
        ),
        (0.25, None),
    ),
    # logits * output_multiplier, then the softcap (a multimodal wrapper's, text config's values)
    "muse_glimmer": (
        lambda: _tiny(
            "MuseGlimmerConfig",
            "MuseGlimmerForConditionalGeneration",
            text_config=dict(TEXT, output_multiplier=0.25, final_logit_softcapping=5.0),
            vision_config=dict(
                VISION, layer_types=["full_attention"], pos_emb_height=4, pos_emb_width=4
            ),
            projector_hidden_size=16,
        ),
        (0.25, 5.0),
    ),
    # hidden states / logits_scaling (hidden_size / dim_model_base) before the head
    "minicpm3": (
        lambda: _tiny(
            "MiniCPM3Config",
            "MiniCPM3ForCausalLM",
            **dict(TEXT, num_key_value_heads=2),
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=8,
            dim_model_base=4,
        ),
        (0.25, None),
    ),
    # hidden states / logits_mup_width_multiplier before the head
    "inkling_text": (
        lambda: _tiny(
            "InklingTextConfig",
            "InklingForCausalLM",
            **TEXT,
            swa_num_attention_heads=2,
            swa_num_key_value_heads=1,
            swa_head_dim=8,
            sliding_window_size=4,
            d_rel=4,
            rel_extent=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            logits_mup_width_multiplier=4.0,
        ),
        (0.25, None),
    ),
    # c * tanh(logits / c)
    "gemma2": (
        lambda: _tiny("Gemma2Config", "Gemma2ForCausalLM", **TEXT, final_logit_softcapping=5.0),
        (1.0, 5.0),
    ),
    "recurrent_gemma": (
        lambda: _tiny(
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            **dict(TEXT, num_hidden_layers=3),
            lru_width=16,
            attention_window_size=8,
            logits_soft_cap=5.0,
        ),
        (1.0, 5.0),
    ),
    "xlstm": (
        lambda: _tiny(
            "xLSTMConfig",
            "xLSTMForCausalLM",
            vocab_size=V,
            hidden_size=16,
            num_heads=2,
            num_hidden_layers=2,
            qk_dim_factor=4.0,
            v_dim_factor=4.0,
            chunk_size=4,
            output_logit_soft_cap=5.0,
        ),
        (1.0, 5.0),
    ),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_fused_log_probs_are_the_models_own(kind: str) -> None:
    build, expected = MODELS[kind]
    _check_matches(build(), expected)


def test_xlstm_caps_its_logits_in_training_too() -> None:
    """xLSTM's forward caps its logits in train mode as in eval mode (in chunks there)."""
    model = MODELS["xlstm"][0]().train()
    _check_matches(model, (1.0, 5.0))


@pytest.mark.parametrize("kind", ["minicpm3", "inkling_text"])
def test_a_head_input_already_holds_the_scale_of_the_hidden_states(kind: str) -> None:
    """A caller standing in for the LM head's forward (OpenRLHF's patch) gets what the head gets:
    hidden states the model has already scaled, so ``head_input=True`` scales by 1 and the
    log-probs are still the model's own (with the decoder's scale applied again they were not)."""
    model = MODELS[kind][0]()
    assert model_logit_transform(model.config, head_input=True) == (1.0, None)
    ids, labels = _batch()
    got: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: got.append(args[0].detach())
    )
    want = _own_log_probs(model, ids, labels)
    hook.remove()
    (head_input,) = got
    fused = _fused(model, head_input, labels, model_logit_transform(model.config, head_input=True))
    torch.testing.assert_close(fused, want, rtol=0, atol=ATOL)
    scaled_again = _fused(model, head_input, labels, model_logit_transform(model.config))
    assert float((scaled_again - want).abs().max()) > 1e-2


@pytest.mark.parametrize("logit_scale", [0.25, "inv_sqrt_d_model", None])
def test_mpts_logit_scale_is_not_applied(logit_scale: float | str | None) -> None:
    """transformers' MPT carries ``logit_scale`` in its config and never applies it: its logits
    are the head's own, and the str value MosaicML's code knows is not read at all."""
    model = _tiny(
        "MptConfig",
        "MptForCausalLM",
        vocab_size=V,
        d_model=16,
        n_heads=2,
        n_layers=2,
        max_seq_len=32,
        logit_scale=logit_scale,
    )
    _check_matches(model, (1.0, None))


@pytest.mark.parametrize("kind", ["aya_vision", "paligemma"])
def test_a_wrapper_that_ignores_its_text_models_transform_is_read_as_it_runs(kind: str) -> None:
    """Aya Vision's Cohere-2 text config has ``logit_scale`` and PaliGemma 2's Gemma-2 text config
    ``final_logit_softcapping``; the multimodal wrapper's own LM head (transformers 5) applies
    neither: read by name they gave other log-probs than the model's."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the wrapper runs the text model's causal-LM class before transformers 5")
    if kind == "aya_vision":
        model = _tiny(
            "AyaVisionConfig",
            "AyaVisionForConditionalGeneration",
            text_config=dict(TEXT, model_type="cohere2", logit_scale=0.25),
            vision_config=dict(
                VISION, model_type="siglip_vision_model", image_size=28, patch_size=14
            ),
            image_token_index=V - 1,
        )
    else:
        model = _tiny(
            "PaliGemmaConfig",
            "PaliGemmaForConditionalGeneration",
            text_config=dict(TEXT, model_type="gemma2", final_logit_softcapping=5.0),
            vision_config=dict(VISION, image_size=28, patch_size=14),
            image_token_index=V - 1,
        )
    _check_matches(model, (1.0, None))
    text = model.config.get_text_config()
    ids, labels = _batch()
    read_by_name = _fused(model, _decoder_hidden(model, ids), labels, model_logit_transform(text))
    assert float((read_by_name - _own_log_probs(model, ids, labels)).abs().max()) > 1e-2


#: LLaVA-style wrappers around a text model with a logit transform: (config class, model class,
#: the text config's fields, the wrapper's own fields).
LLAVA_WRAPPERS: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # Granite Vision 3.x: LLaVA-NeXT around a Granite text config
    "llava_next-granite": (
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        dict(model_type="granite", logits_scaling=8.0),
        dict(image_grid_pinpoints=[[28, 28]]),
    ),
    "llava-cohere": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        dict(model_type="cohere", logit_scale=0.25),
        {},
    ),
    "llava-gemma2": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        dict(model_type="gemma2", final_logit_softcapping=5.0),
        {},
    ),
}


@pytest.mark.parametrize("kind", list(LLAVA_WRAPPERS))
def test_a_llava_wrapper_applies_none_of_its_text_models_transforms(kind: str) -> None:
    """A LLaVA wrapper's logits are its ``lm_head`` of the text model's body (transformers 5),
    whatever transform the text model's own causal-LM class applies: read as no transform. They
    were refused by the scan for transform-like attributes (Granite Vision 3.x among them)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the wrapper runs the text model's causal-LM class before transformers 5")
    config_cls, model_cls, text, extra = LLAVA_WRAPPERS[kind]
    model = _tiny(
        config_cls,
        model_cls,
        text_config=dict(TEXT, **text),
        vision_config=dict(VISION, model_type="siglip_vision_model", image_size=28, patch_size=14),
        image_token_index=V - 1,
        **extra,
    )
    _check_matches(model, (1.0, None))
    text_transform = model_logit_transform(model.config.get_text_config())
    assert text_transform != (1.0, None)  # the text model's own class would apply it


#: A tiny Llama 4 text model's fields (two experts, chunked attention).
LLAMA4_TEXT: dict[str, Any] = dict(
    TEXT, num_local_experts=2, intermediate_size_mlp=32, attention_chunk_size=8
)


def _llama4_text() -> Any:
    return _tiny("Llama4TextConfig", "Llama4ForCausalLM", **LLAMA4_TEXT)


def _mllama_text() -> Any:
    return _tiny(
        "MllamaTextConfig",
        "MllamaForCausalLM",
        **TEXT,
        cross_attention_layers=[1],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama4() -> Any:
    return _tiny(
        "Llama4Config",
        "Llama4ForConditionalGeneration",
        text_config=LLAMA4_TEXT,
        vision_config=dict(
            VISION,
            image_size=28,
            patch_size=14,
            vision_output_dim=16,
            projector_input_dim=16,
            projector_output_dim=16,
        ),
        image_token_index=V - 1,
        boi_token_index=V - 2,
        eoi_token_index=V - 3,
    )


#: Causal LMs whose ``base_model_prefix`` names no attribute of their own (Llama 4's and Mllama's
#: text LMs: ``language_model``), and a wrapper whose ``get_decoder()`` is its inner causal LM.
OWN_BASE_MODEL: dict[str, Callable[[], Any]] = {
    "llama4_text": _llama4_text,
    "mllama_text": _mllama_text,
    "llama4": _llama4,
}


@pytest.mark.parametrize("kind", list(OWN_BASE_MODEL))
def test_causal_lm_logprobs_scores_the_body_under_a_causal_lm_inside_a_model(kind: str) -> None:
    """``causal_lm_logprobs`` reads the hidden states of the decoder body, never a causal LM's
    logits: Llama 4's wrapper's ``get_decoder()`` is its inner ``Llama4ForCausalLM``, whose logits
    were scored as hidden states (a width mismatch named instead of the cause)."""
    from fusedhead.integrations.transformers import causal_lm_logprobs

    model = OWN_BASE_MODEL[kind]()
    ids, labels = _batch()
    want = _own_log_probs(model, ids, labels)
    with torch.no_grad():
        got = causal_lm_logprobs(model, ids, config="torch").log_probs.double()
    # causal_lm_logprobs scores position t's next token: the labels' layout above
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["llama4_text", "mllama_text"])
def test_trls_fused_head_finds_the_body_of_a_causal_lm_whose_base_model_is_itself(
    kind: str,
) -> None:
    """TRL's ``add_fused_lm_head`` runs ``model.base_model``: for these LMs that is the LM itself,
    and the first fused forward raised "cannot find the backbone"."""
    pytest.importorskip("trl")
    from fusedhead.integrations.trl import add_fused_lm_head

    model = OWN_BASE_MODEL[kind]()
    assert model.base_model is model
    ids, labels = _batch()
    want = _own_log_probs(model, ids, labels)
    add_fused_lm_head(model, head="torch")
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, shift_labels=labels, fused_lm_head=True)
    got = out.log_probs.double().masked_fill(labels == -100, 0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_a_plain_model_with_a_head_bias_is_not_refused() -> None:
    """Phi's LM head has a bias, which the fused head adds as the head does: no transform."""
    model = _tiny("PhiConfig", "PhiForCausalLM", **TEXT)
    assert model.get_output_embeddings().bias is not None
    _check_matches(model, (1.0, None))


@pytest.mark.parametrize(
    "config_cls",
    ["LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig", "GemmaConfig", "PhiConfig"],
)
def test_plain_models_have_no_transform(config_cls: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_cls)()
    assert model_logit_transform(config) == (1.0, None)
    assert model_logit_transform(config, head_input=True) == (1.0, None)


def test_no_causal_lm_outside_the_table_is_refused_by_its_default_config() -> None:
    """Every model type ``AutoModelForCausalLM`` or ``AutoModelForImageTextToText`` builds that the
    table does not list passes with its default config: the check of attributes that look like a
    logit transform refuses none of transformers' own plain models (a new one with such an
    attribute fails here, and belongs in the table)."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    types = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    types |= set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    refused = {}
    for model_type in sorted(types - set(MODEL_LOGIT_TRANSFORMS)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # a config that needs arguments: nothing to check by default
                continue
        try:
            model_logit_transform(config)
        except ValueError as e:
            if str(e).startswith("model.config"):  # ours, not transformers' get_text_config
                refused[model_type] = str(e)
    assert not refused


REFUSED: list[tuple[Any, str]] = [
    # a transform the table says fusedhead does not reproduce
    (NS(model_type="chameleon"), r"^model.config.model_type='chameleon': its forward sets the "),
    (NS(model_type="bert"), r"^model.config.model_type='bert': its forward runs a prediction head"),
    (
        NS(model_type="gemma4_assistant", use_ordered_embeddings=True),
        r"^model.config.use_ordered_embeddings=True \(gemma4_assistant\): its forward then scores",
    ),
    # a model type the table does not list, with an attribute that looks like a logit transform
    (
        NS(model_type="llama", logit_scale=0.5),
        r"^model.config.logit_scale=0.5 \(llama\): fusedhead's table .* no entry for model_type "
        r"'llama', and it looks like a transform of the logits",
    ),
    (
        NS(model_type="my_lm", final_logit_softcapping=30.0),
        r"^model.config.final_logit_softcapping=30.0 \(my_lm\)",
    ),
    (
        NS(model_type="my_lm", output_logit_scale=2.0),
        r"^model.config.output_logit_scale=2.0 \(my_lm\)",
    ),
    (  # remote-code MiniCPM: hidden states / (hidden_size / dim_model_base)
        NS(model_type="minicpm", hidden_size=2304, dim_model_base=256),
        r"^model.config.dim_model_base=256 \(minicpm\)",
    ),
    # a config without a model type: the documented names are read, any other refused
    (NS(output_logit_scale=2.0), r"^model.config.output_logit_scale=2.0 \(\?\): the config names"),
    # ProphetNet's logits are its first n-gram predicting stream's: scoring its decoder's last
    # hidden state gave log-probs 1.9 off, without a word
    (
        NS(model_type="prophetnet"),
        r"^model.config.model_type='prophetnet': its forward scores its first n-gram predicting",
    ),
    # an attribute the table's entry reads, missing: none of transformers' configs of that type
    (NS(model_type="granite"), r"^model.config has no logits_scaling, which the forward of"),
]


@pytest.mark.parametrize(("config", "words"), REFUSED)
def test_a_transform_fusedhead_does_not_reproduce_is_refused(config: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        model_logit_transform(config)
    assert "fusedhead does not reproduce" in str(info.value)
    assert "score this model with its own logits" in str(info.value)


def test_a_remote_code_config_is_not_read_by_its_model_type() -> None:
    """MosaicML's own MPT code (``trust_remote_code``) applies the ``logit_scale`` transformers'
    MPT ignores: a config class from a Hub repository's code is refused where it sets one."""
    remote = type("MPTConfig", (), {"__module__": "transformers_modules.mosaicml.mpt_7b.config"})
    config = remote()
    config.model_type, config.logit_scale = "mpt", "inv_sqrt_d_model"
    words = (
        r"^model.config.logit_scale='inv_sqrt_d_model' \(mpt\): its config class "
        r"transformers_modules.mosaicml.mpt_7b.config.MPTConfig is remote code"
    )
    with pytest.raises(ValueError, match=words):
        model_logit_transform(config)
    config.logit_scale = None  # nothing that looks like a transform: no scale, no softcap
    assert model_logit_transform(config) == (1.0, None)


@pytest.mark.parametrize(
    ("attrs", "error", "words"),
    [
        ({"model_type": "granite", "logits_scaling": "8"}, TypeError, r"got str '8'"),
        ({"model_type": "granite", "logits_scaling": 0.0}, ValueError, r"\(no scale\), got 0.0"),
        ({"model_type": "cohere", "logit_scale": True}, TypeError, r"got bool True"),
        ({"model_type": "cohere", "logit_scale": -0.5}, ValueError, r"finite number > 0"),
        ({"model_type": "minicpm3", "logits_scaling": float("inf")}, ValueError, r"got inf"),
        ({"model_type": "xlstm", "output_logit_soft_cap": 0}, ValueError, r"\(no softcap\)"),
        ({"logit_scale": "inv_sqrt_d_model"}, TypeError, r"got str 'inv_sqrt_d_model'"),
    ],
    ids=["str", "zero", "bool", "negative", "inf", "cap-zero", "no-type-str"],
)
def test_a_bad_value_is_refused_by_its_name(
    attrs: dict[str, Any], error: type[Exception], words: str
) -> None:
    attr = next(a for a in attrs if a != "model_type")
    with pytest.raises(error, match=rf"^model.config.{attr} must be a .*{words}"):
        model_logit_transform(NS(**attrs))


def test_a_head_inputs_own_scale_is_still_checked() -> None:
    config = NS(model_type="minicpm3", logits_scaling="10")
    with pytest.raises(TypeError, match=r"^model.config.logits_scaling must be a number"):
        model_logit_transform(config, head_input=True)
    with pytest.raises(TypeError, match=r"^head_input must be a bool, got int 1"):
        model_logit_transform(NS(model_type="minicpm3", logits_scaling=10.0), head_input=1)  # type: ignore[arg-type]


def test_the_table_reads_the_text_config_and_decides_by_the_outer_type() -> None:
    """A multimodal config: the wrapper's type decides, the text config holds the values."""
    text = NS(model_type="cohere2", logit_scale=0.25)
    assert model_logit_transform(NS(model_type="aya_vision", get_text_config=lambda: text)) == (
        1.0,
        None,
    )
    assert model_logit_transform(text) == (0.25, None)  # Cohere-2's own causal LM
    granite_text = NS(model_type="granite4_vision_text", logits_scaling=8.0)
    vision = NS(model_type="granite4_vision", get_text_config=lambda: granite_text)
    assert model_logit_transform(vision) == (0.125, None)
    muse = NS(model_type="muse_spark_text", output_multiplier=0.5, final_logit_softcapping=20.0)
    assert model_logit_transform(muse) == (0.5, 20.0)
    assert model_logit_transform(NS(model_type="cohere_compass", logit_scale=None)) == (1.0, None)
    assert model_logit_transform(None) == (1.0, None)  # no config at all


def test_a_wrappers_ignored_attribute_is_refused_before_transformers_5(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 4 could run the text model's causal-LM class inside the wrapper, which
    applies the transform transformers 5's wrapper ignores: which one runs is not told there."""
    text = NS(model_type="gemma2", final_logit_softcapping=30.0)
    config = NS(model_type="paligemma", get_text_config=lambda: text)
    monkeypatch.setattr(logit_transforms, "_transformers_major", lambda: 4)
    words = r"^model.config.final_logit_softcapping=30.0 \(paligemma\): transformers 5's paligemma"
    with pytest.raises(ValueError, match=words):
        model_logit_transform(config)
    # A LLaVA wrapper holds any text model: every transform-like attribute of its text config is
    # refused there, RecurrentGemma's and a remote-code model's names too (not a list of names).
    for attr in ("logits_soft_cap", "output_logit_soft_cap", "my_logit_multiplier"):
        inner = NS(model_type="my_text", **{attr: 30.0})
        wrapper = NS(model_type="llava", get_text_config=lambda inner=inner: inner)
        with pytest.raises(ValueError, match=rf"^model.config.{attr}=30.0 \(llava\): transformers"):
            model_logit_transform(wrapper)
    text.final_logit_softcapping = None  # PaliGemma 1's Gemma text config: nothing to tell apart
    assert model_logit_transform(config) == (1.0, None)
    monkeypatch.setattr(logit_transforms, "_transformers_major", lambda: 5)
    assert model_logit_transform(
        NS(
            model_type="paligemma",
            get_text_config=lambda: NS(model_type="gemma2", final_logit_softcapping=30.0),
        )
    ) == (1.0, None)


def test_a_mapping_config_is_read_by_its_keys() -> None:
    """A dict (or OmegaConf) config: its keys are read and scanned as a transformers config's
    attributes are (a dict's keys are no attributes: a softcap there was silently dropped)."""
    assert model_logit_transform({"model_type": "gemma2", "final_logit_softcapping": 5.0}) == (
        1.0,
        5.0,
    )
    assert model_logit_transform({"final_logit_softcapping": 5.0}) == (1.0, 5.0)
    assert model_logit_transform({"model_type": "granite", "logits_scaling": 4.0}) == (0.25, None)
    with pytest.raises(ValueError, match=r"^model.config.logit_softcap=30 \(my_lm\)"):
        model_logit_transform({"model_type": "my_lm", "logit_softcap": 30})
    wrapped = {
        "model_type": "aya_vision",
        "text_config": {"model_type": "cohere2", "logit_scale": 4},
    }
    assert model_logit_transform(wrapped) == (1.0, None)


def test_the_table_names_only_model_types_transformers_knows() -> None:
    """Read from transformers 5.22: a misspelt model type would never match."""
    from transformers.models.auto.configuration_auto import (  # type: ignore[attr-defined]
        CONFIG_MAPPING_NAMES,
    )

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 22):
        pytest.skip("the table names model types of transformers 5.22")
    unknown = sorted(set(MODEL_LOGIT_TRANSFORMS) - set(CONFIG_MAPPING_NAMES))
    assert not unknown, unknown
    for model_type, entry in MODEL_LOGIT_TRANSFORMS.items():
        for scale in (entry.hidden, entry.logits):
            assert scale is None or scale[1] in ("*", "/"), model_type
        assert all(re.fullmatch(r"[a-z_0-9]+", a) for a in entry.ignores), model_type


def test_a_transform_set_on_the_config_class_is_seen() -> None:
    """DiffusionGemma's text config sets final_logit_softcapping = 30.0 on its class, in no
    instance __dict__: the table applies it, and the scan for unknown transform-like attributes
    reads class attributes too (it read the instance's only, and the cap was dropped)."""
    config = transformers.AutoConfig.for_model("diffusion_gemma")
    assert "final_logit_softcapping" not in vars(config.get_text_config())
    assert model_logit_transform(config) == (1.0, 30.0)

    class MyConfig(transformers.PretrainedConfig):
        model_type = "my_lm_with_a_class_scale"
        output_logit_multiplier = 2.0

    with pytest.raises(ValueError, match=r"^model.config.output_logit_multiplier=2.0 \(my_lm"):
        model_logit_transform(MyConfig())
