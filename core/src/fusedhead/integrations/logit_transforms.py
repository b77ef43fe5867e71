"""What a Hugging Face causal LM does to its logits between its decoder and its output, by model
type: the scales and softcap a fused head must apply to give the model's own log-probs, and the
transforms it must refuse. Read from transformers' modeling code (``MODEL_LOGIT_TRANSFORMS``);
shared by every trainer's glue through :func:`model_logit_transform`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import Any

from fusedhead.errors import type_name
from fusedhead.module import SOFTCAP_ATTRIBUTES, config_positive, config_softcap

__all__ = ["MODEL_LOGIT_TRANSFORMS", "LogitTransform", "model_logit_transform"]


@dataclass(frozen=True)
class LogitTransform:
    """What one model type's forward does between its decoder's last hidden state and its logits.

    Each scale is ``(attribute, op)``: the (text) config's attribute and whether the forward
    multiplies (``"*"``) or divides (``"/"``) by it; the attribute set to None is no scale.
    ``hidden`` scales the hidden states before the LM head (exact here only for a head without a
    bias, as every such head in the table is: ``(s * h) @ W.T == s * (h @ W.T)``), ``logits``
    scales the logits after it, then ``softcap`` names a ``c * tanh(z / c)`` cap (None: none).
    ``ignores``: attributes its config carries that this forward never applies (read by name
    they gave other log-probs than the model's); ``wrapper``: a multimodal wrapper whose own LM
    head ignores every transform of its text model in transformers 5 (transformers 4 could run
    the text model's causal-LM class, which applies it: there any transform-like attribute of
    the text config is refused). ``refuses``: a transform fusedhead does not
    reproduce, always; ``refuses_when``: ``(attribute, transform)``, refused where the attribute
    is set (truthy).
    """

    hidden: tuple[str, str] | None = None
    logits: tuple[str, str] | None = None
    softcap: str | None = None
    ignores: tuple[str, ...] = ()
    wrapper: bool = False
    refuses: str | None = None
    refuses_when: tuple[str, str] | None = None


_PREDICTION_HEAD = LogitTransform(
    refuses="runs a prediction head (dense layer, activation, LayerNorm) on the hidden states "
    "before its output projection"
)
_SOFTCAP = LogitTransform(softcap="final_logit_softcapping")
_COHERE = LogitTransform(logits=("logit_scale", "*"))
_GRANITE = LogitTransform(logits=("logits_scaling", "/"))
_HYPERCLOVAX = LogitTransform(logits=("logits_scaling", "*"))
_MUSE = LogitTransform(logits=("output_multiplier", "*"), softcap="final_logit_softcapping")
_INKLING = LogitTransform(hidden=("logits_mup_width_multiplier", "/"))
_ASSISTANT = LogitTransform(
    ignores=("final_logit_softcapping",),
    refuses_when=(
        "use_ordered_embeddings",
        "scores its hidden states against an ordered subset of the embeddings",
    ),
)

#: The model types whose logit transform ``model_logit_transform`` knows, read from the forward of
#: the class ``AutoModelForCausalLM`` (a multimodal model: ``AutoModelForImageTextToText``) builds
#: for each in transformers 5.22. A ``*_text`` type without a causal-LM class of its own (a text
#: config handed over alone) has its wrapper's transform. Every other model type applies none:
#: its config is only checked for an attribute that looks like a logit transform.
MODEL_LOGIT_TRANSFORMS: Mapping[str, LogitTransform] = MappingProxyType(
    {
        # logits * logit_scale (Cohere Compass: None is 1)
        **dict.fromkeys(
            ("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"), _COHERE
        ),
        # logits / logits_scaling
        **dict.fromkeys(
            (
                "granite",
                "granite_swa",
                "granitemoe",
                "granitemoe_swa",
                "granitemoehybrid",
                "granitemoeshared",
                "granite4_vision",
                "granite4_vision_text",
            ),
            _GRANITE,
        ),
        # logits * logits_scaling (muP)
        **dict.fromkeys(("hyperclovax", "hyperclovax_vision_v2"), _HYPERCLOVAX),
        "falcon_h1": LogitTransform(logits=("lm_head_multiplier", "*")),
        # logits * output_multiplier, then the softcap
        **dict.fromkeys(
            ("muse_glimmer", "muse_glimmer_text", "muse_spark", "muse_spark_text"), _MUSE
        ),
        # hidden states / logits_scaling (hidden_size / dim_model_base) before the head
        "minicpm3": LogitTransform(hidden=("logits_scaling", "/")),
        # hidden states / logits_mup_width_multiplier before the head (a padded vocabulary that
        # unpadded_vocab_size slices off is refused for every model type)
        **dict.fromkeys(("inkling_text", "inkling_mm_model"), _INKLING),
        # c * tanh(logits / c)
        **dict.fromkeys(
            (
                "gemma2",
                "gemma3_text",
                "diffusion_gemma",
                "diffusion_gemma_text",
                "gemma3n",
                "gemma3n_text",
                "gemma4",
                "gemma4_text",
                "gemma4_unified",
                "gemma4_unified_text",
                "vaultgemma",
                "nanochat",
                "beam",
                "mistral_large4",
                "mistral_large4_text",
            ),
            _SOFTCAP,
        ),
        "recurrent_gemma": LogitTransform(softcap="logits_soft_cap"),
        "xlstm": LogitTransform(softcap="output_logit_soft_cap"),
        # no transform, though the config carries one's attribute
        "mpt": LogitTransform(ignores=("logit_scale",)),
        **dict.fromkeys(
            ("aya_vision", "cohere2_vision"), LogitTransform(ignores=("logit_scale",), wrapper=True)
        ),
        **dict.fromkeys(
            ("granite_speech", "granite_speech_plus"),
            LogitTransform(ignores=("logits_scaling",), wrapper=True),
        ),
        # LLaVA-style wrappers: logits = lm_head(hidden states), whatever text model they hold
        # (Granite Vision 3.x is llava_next with a Granite text config and its logits_scaling)
        **dict.fromkeys(
            (
                "llava",
                "llava_next",
                "llava_next_video",
                "llava_onevision",
                "vipllava",
                "mistral3",
            ),
            LogitTransform(wrapper=True),
        ),
        **dict.fromkeys(
            ("gemma3", "shieldgemma2", "paligemma"),
            LogitTransform(ignores=("final_logit_softcapping",), wrapper=True),
        ),
        **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), _ASSISTANT),
        # transforms fusedhead does not reproduce
        "chameleon": LogitTransform(
            refuses="sets the logits of its image tokens to the dtype's minimum"
        ),
        "prophetnet": LogitTransform(
            refuses="scores its first n-gram predicting stream, not the decoder's last hidden state"
        ),
        **dict.fromkeys(
            (
                "bert",
                "big_bird",
                "camembert",
                "data2vec-text",
                "electra",
                "ernie",
                "megatron-bert",
                "modernbert-decoder",
                "rembert",
                "roberta",
                "roberta-prelayernorm",
                "roc_bert",
                "roformer",
                "xlm-roberta",
                "xlm-roberta-xl",
                "xmod",
            ),
            _PREDICTION_HEAD,
        ),
    }
)

#: Config attribute names that look like a transform of the logits (a scale, a multiplier, a
#: softcap; ``dim_model_base``: MiniCPM's hidden-state divisor ``hidden_size / dim_model_base``)...
_LOGIT_NAME = re.compile(r"logit|soft_?cap|multiplier|scaling|dim_model_base", re.IGNORECASE)
#: ...unless the name says it is about something else (attention, routing, RoPE, embeddings, the
#: residual stream, initialisation, a loss), or it is a flag asking for outputs.
_OTHER_NAME = re.compile(
    r"attn|attention|router|routed|moe|expert|rope|embed|residual|key|query|value|ssm|mlp|ffn"
    r"|gate|to_keep|init|loss|layer|depth|conv|time|noise|vision|audio|image"
    r"|^(output|return)_\w*logits$",
    re.IGNORECASE,
)
_CAP_NAME = re.compile(r"soft_?cap|_cap$|capping", re.IGNORECASE)

_REFUSED = "fusedhead does not reproduce this transform: score this model with its own logits"


def model_logit_transform(config: Any, *, head_input: bool = False) -> tuple[float, float | None]:
    """``(logit_scale, softcap)`` that reproduce a Hugging Face model's logits from its hidden states.

    Decided by ``config.model_type`` (of the config given, else of its ``get_text_config()``)
    from ``MODEL_LOGIT_TRANSFORMS``, read from transformers' modeling code: the scales of the
    hidden states before the LM head (MiniCPM3, Inkling) and of the logits after it (Cohere's
    ``logit_scale``, Granite's ``1 / logits_scaling``, HyperCLOVA X's ``logits_scaling``,
    Falcon-H1's ``lm_head_multiplier``, Muse's ``output_multiplier``) multiply into one
    ``logit_scale``, applied before the softcap (Gemma-2 and later, VaultGemma, NanoChat, Beam,
    Mistral Large 4: ``final_logit_softcapping``; RecurrentGemma: ``logits_soft_cap``; xLSTM:
    ``output_logit_soft_cap``). An attribute a model type's forward never applies is not read
    (MPT's ``logit_scale``, the ``logit_scale`` of Aya Vision's Cohere-2 text config, ...).

    ``head_input``: the hidden states scored are the LM head's own input (a caller standing in
    for the head's forward), which already hold the scale the model applies before its head;
    False: the decoder's last hidden state. The values are checked by their names (a str, a bool,
    0 or inf is refused). A ValueError, naming the attribute, refuses what fusedhead does not
    reproduce: a model type whose forward does something else to its logits (masking, a
    prediction head before the output projection), a model that drops its head's padded rows
    (``unpadded_vocab_size``: the fused head normalises over every row), and a model type not
    in the table (or a remote-code config, whose forward the table does not describe) whose
    config sets an attribute that looks like a logit transform. A config with no model type (not
    a transformers config) is read by the attribute names above.
    """
    if not isinstance(head_input, bool):
        raise TypeError(f"head_input must be a bool, got {type_name(head_input)} {head_input!r}")
    if isinstance(config, Mapping):  # a dict or OmegaConf config: its keys are its attributes
        config = _namespace(config)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    model_type = _model_type(config, text)
    unpadded, vocab = getattr(text, "unpadded_vocab_size", None), getattr(text, "vocab_size", None)
    if unpadded is not None and unpadded != vocab:
        raise ValueError(
            f"model.config.unpadded_vocab_size={unpadded!r} ({model_type or '?'}, "
            f"vocab_size={vocab!r}): the model drops its head's padded rows from the logits, and a "
            "fused head normalises over every row of the weight, so its log-probs would differ; "
            "not supported: score this model with its own logits"
        )
    remote = _remote_code(config, text)
    entry = None if remote is not None else MODEL_LOGIT_TRANSFORMS.get(model_type or "")
    if entry is not None:
        assert model_type is not None
        return _table_transform(config, text, model_type, entry, head_input)
    if model_type is None:
        return _named_transform(config, text)
    if remote is not None:
        why = (
            f"its config class {remote} is remote code (trust_remote_code), whose forward "
            "fusedhead's table of logit transforms does not describe"
        )
    else:
        why = (
            f"fusedhead's table of logit transforms (MODEL_LOGIT_TRANSFORMS, read from "
            f"transformers' modeling code) has no entry for model_type {model_type!r}"
        )
    _refuse_transform_like(config, text, model_type, why)
    return 1.0, None


def _namespace(config: Mapping[Any, Any]) -> SimpleNamespace:
    """A mapping config as attributes (its text config too), so that its keys are read and
    scanned as a transformers config's attributes are: a dict's keys are no attributes, and an
    OmegaConf config lists none of them in ``dir()``."""
    fields = {str(k): v for k, v in config.items()}
    text = fields.get("text_config")
    if isinstance(text, Mapping):
        fields["text_config"] = inner = _namespace(text)
        fields["get_text_config"] = lambda: inner
    return SimpleNamespace(**fields)


def _model_type(config: Any, text: Any) -> str | None:
    """The model type of ``config``, else of its text config; None where neither names one."""
    for source in (config, text):
        model_type = getattr(source, "model_type", None)
        if isinstance(model_type, str) and model_type:
            return model_type
    return None


def _remote_code(config: Any, text: Any) -> str | None:
    """The config's class name where it comes from a Hub repository's own code (loaded with
    ``trust_remote_code``, under ``transformers_modules``): the model type then names code the
    table was not read from (MosaicML's MPT applies the ``logit_scale`` transformers' MPT does
    not)."""
    for source in (config, text):
        cls = type(source)
        if cls.__module__.startswith("transformers_modules"):
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


def _table_transform(
    config: Any, text: Any, model_type: str, entry: LogitTransform, head_input: bool
) -> tuple[float, float | None]:
    """``model_logit_transform`` of a model type in ``MODEL_LOGIT_TRANSFORMS``."""
    if entry.refuses is not None:
        raise ValueError(
            f"model.config.model_type={model_type!r}: its forward {entry.refuses}; {_REFUSED}"
        )
    if entry.refuses_when is not None:
        attr, what = entry.refuses_when
        value = getattr(config, attr, getattr(text, attr, None))
        if value:
            raise ValueError(
                f"model.config.{attr}={value!r} ({model_type}): its forward then {what}; {_REFUSED}"
            )
    if entry.wrapper and (major := _transformers_major()) is not None and major < 5:
        why = (
            f"transformers 5's {model_type} does not apply its text model's transform, and "
            f"transformers {major}.x's may (it can run the text model's causal-LM class, which "
            "does), so fusedhead cannot tell which runs: use transformers >= 5"
        )
        _refuse_transform_like(config, text, model_type, why)
    scale = 1.0
    for which in (entry.hidden, entry.logits):
        if which is None:
            continue
        attr, op = which
        value = _table_value(text, model_type, attr, "no scale")
        if value is None or (which is entry.hidden and head_input):
            continue  # a head's input already holds the scale of the hidden states
        scale = scale * value if op == "*" else scale / value
    softcap = None
    if entry.softcap is not None:
        softcap = _table_value(text, model_type, entry.softcap, "no softcap")
    return scale, softcap


def _table_value(text: Any, model_type: str, attr: str, none_means: str) -> float | None:
    """The (text) config's ``attr``, which ``model_type``'s forward reads, checked by its name; a
    config without it is none of transformers' ``model_type``: refused, not read as no
    transform."""
    if not hasattr(text, attr):
        raise ValueError(
            f"model.config has no {attr}, which the forward of transformers' {model_type} reads "
            f"(model_type={model_type!r}); {_REFUSED}"
        )
    return config_positive(attr, getattr(text, attr), none_means)


#: The attribute names read from a config that names no model type, in this order, by what the
#: first set does: multiply the logits, or divide them (Granite's convention).
_NAMED_SCALES = (
    ("logit_scale", "*"),
    ("output_multiplier", "*"),
    ("lm_head_multiplier", "*"),
    ("logits_scaling", "/"),
)


def _named_transform(config: Any, text: Any) -> tuple[float, float | None]:
    """``model_logit_transform`` of a config that names no model type (a hand-built one, not a
    transformers config): the first of ``_NAMED_SCALES`` set and the softcap of
    ``SOFTCAP_ATTRIBUTES``, as fusedhead documents them; any other attribute that looks like a
    logit transform is refused, since nothing tells what the forward does with it."""
    softcap = config_softcap(text)
    scale = 1.0
    for attr, op in _NAMED_SCALES:
        value = config_positive(attr, getattr(text, attr, None), "no scale")
        if value is not None:
            scale = value if op == "*" else 1.0 / value
            break
    read = {attr for attr, _ in _NAMED_SCALES} | set(SOFTCAP_ATTRIBUTES)
    why = "the config names no model_type, and fusedhead reads no attribute of this name"
    _refuse_transform_like(config, text, None, why, read=read)
    return scale, softcap


def _refuse_transform_like(
    config: Any, text: Any, model_type: str | None, why: str, read: set[str] | None = None
) -> None:
    """A ValueError naming the first attribute of ``config`` or its text config (other than the
    ``read`` ones) that looks like a logit transform and is set to other than its neutral value:
    where fusedhead cannot tell what the forward does with it."""
    seen: set[str] = set(read or ())
    for source in (text, config):
        for attr in _transform_like_names(source):
            if attr in seen:
                continue
            seen.add(attr)
            try:
                value = getattr(source, attr)
            except Exception:  # a property that raises: not a setting
                continue
            if callable(value) or _neutral(attr, value, text):
                continue
            raise ValueError(
                f"model.config.{attr}={value!r} ({model_type or '?'}): {why}, and it looks like a "
                f"transform of the logits (a scale, a multiplier or a softcap); {_REFUSED}"
            )


def _transform_like_names(source: Any) -> list[str]:
    """The names of a config's attributes that look like a logit transform: its instance's and
    its classes' (a class attribute such as DiffusionGemma's ``final_logit_softcapping = 30.0``
    is in no instance ``__dict__``), public, matched by name before any is read (a property of
    transformers' base config class warns that it is deprecated, and reading every attribute
    took 2 ms a call)."""
    if source is None:
        return []
    names = set(getattr(source, "__dict__", {}))
    for cls in type(source).__mro__:
        if cls.__module__ not in _BASE_CONFIG_MODULES:
            names.update(cls.__dict__)
    return sorted(n for n in names if isinstance(n, str) and _transform_like(n))


@functools.lru_cache(maxsize=4096)
def _transform_like(name: str) -> bool:
    """Whether a public attribute ``name`` looks like a logit transform (cached: a config has
    about a hundred names, the same on every call)."""
    return (
        not name.startswith("_") and bool(_LOGIT_NAME.search(name)) and not _OTHER_NAME.search(name)
    )


#: Modules of base classes whose attributes are generic, never a model's transform: transformers'
#: ``PretrainedConfig`` and Python's ``object``.
_BASE_CONFIG_MODULES = frozenset({"builtins", "transformers.configuration_utils"})


def _neutral(attr: str, value: object, text: Any) -> bool:
    """Whether ``value`` of a logit-transform-like ``attr`` transforms nothing: None or False; 1
    for a scale, 0 for a cap; ``dim_model_base`` equal to ``hidden_size``."""
    if value is None or value is False:
        return True
    if attr == "dim_model_base":
        return bool(value == getattr(text, "hidden_size", None))
    if value is True or not isinstance(value, numbers.Real):
        return False
    return value == (0 if _CAP_NAME.search(attr) else 1)


@functools.lru_cache(maxsize=1)
def _transformers_major() -> int | None:
    """The installed transformers' major version; None where it is not installed."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
