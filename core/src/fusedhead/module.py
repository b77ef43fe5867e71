"""``FusedLMHead``: an ``nn.Module`` LM head whose forward returns per-token log-probs and entropy.

It holds the LM head's ``weight`` Parameter (shared, never copied: tied input/output embeddings
stay tied) and reads it inside its own ``forward``. Under FSDP2 (``fully_shard``) that is where
the weight is a plain unsharded tensor: FSDP's pre-forward hook all-gathers it and its
post-forward hook reshards it, exactly as for the ``nn.Linear`` it replaces.

Bias: an ``nn.Linear`` with a bias is supported by folding the bias into an augmented column,
``[h, 1] @ [W, b].T == h @ W.T + b``. That costs a ``[V, H + 1]`` copy of the weight per call;
heads without bias (Llama, Qwen, Gemma, Mistral) pay nothing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from fusedhead import rank_agreement
from fusedhead.api import FusedHead, FusedHeadOutput
from fusedhead.checks import is_dtensor, tensor_arg, width_mismatch
from fusedhead.config import FusedHeadConfig
from fusedhead.errors import type_name
from fusedhead.graph import tracing
from fusedhead.request import HeadRequest, head_request

ConfigLike = FusedHeadConfig | Mapping[str, Any] | FusedHead | None
T = TypeVar("T")


def resolve_head(config: ConfigLike, **overrides: Any) -> FusedHead:
    """A ``FusedHead`` from a config, a mapping, an existing ``FusedHead`` or None (defaults)."""
    if isinstance(config, FusedHead):
        if overrides:
            return FusedHead(config.config, **overrides)
        return config
    if config is not None and not isinstance(config, (FusedHeadConfig, Mapping)):
        raise TypeError(
            "config must be a FusedHeadConfig, a mapping, a FusedHead or None, "
            f"got {type(config).__name__}"
        )
    return FusedHead(config, **overrides)


class FusedLMHead(nn.Module):
    """LM head computing ``log_softmax(softcap(hidden @ W.T [+ b]) / T)[label]`` and the entropy.

    Build it from an ``nn.Linear`` (``FusedLMHead.from_linear``), from a weight Parameter (tied
    embeddings: pass ``embedding.weight``), or from a model (``FusedLMHead.from_model``). The
    backend is the one named by ``config`` (default ``"torch"``), resolved once here. Its
    parameters are named ``weight`` and ``bias`` like ``nn.Linear``'s, so it can replace a
    model's ``lm_head`` with the same state-dict keys.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        weight: nn.Parameter,
        config: ConfigLike = None,
        *,
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter):
            raise TypeError(
                f"weight must be an nn.Parameter (shared with the model, so FSDP and optimizers see one "
                f"tensor), got {type(weight).__name__}; wrap a tensor with nn.Parameter(t)"
            )
        if is_dtensor(weight):
            raise TypeError(
                "weight is already a DTensor (sharded by FSDP2): build FusedLMHead from the model's "
                "parameters before calling fully_shard, and put it inside the sharded model"
            )
        if weight.dim() != 2:
            raise ValueError(f"weight must have shape [V, H], got shape {tuple(weight.shape)}")
        if bias is not None:
            if not isinstance(bias, nn.Parameter):
                raise TypeError(f"bias must be an nn.Parameter or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(
                    f"bias must have shape [V]=({weight.shape[0]},) to match weight {tuple(weight.shape)}, "
                    f"got {tuple(bias.shape)}"
                )
        self.weight = weight
        self.bias = bias
        self.head = resolve_head(config)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: ConfigLike = None) -> FusedLMHead:
        """Share an ``nn.Linear`` LM head's weight (and bias, if any)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear LM head, got {type(linear).__name__}")
        return cls(_param(linear.weight), config, bias=getattr(linear, "bias", None))

    @classmethod
    def from_model(cls, model: nn.Module, config: ConfigLike = None) -> FusedLMHead:
        """Share the LM head of ``model`` (``model.lm_head`` or ``model.get_output_embeddings()``).

        A ``softcap`` left unset in ``config`` is taken from ``model.config.final_logit_softcapping``
        (Gemma-2 style models), so the head scores what the model's logits would.
        """
        head = output_head(model)
        cfg = _with_model_softcap(config, model)
        if isinstance(head, FusedLMHead):
            return cls(head.weight, cfg if cfg is not None else head.head, bias=head.bias)
        return cls.from_linear(head, cfg)

    @property
    def config(self) -> FusedHeadConfig:
        """The resolved configuration (backend, options, call defaults)."""
        return self.head.config

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @in_features.setter
    def in_features(self, value: int) -> None:
        self._same_size("in_features", value, 1)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @out_features.setter
    def out_features(self, value: int) -> None:
        self._same_size("out_features", value, 0)

    def _same_size(self, name: str, value: object, dim: int) -> None:
        """Set as on ``nn.Linear`` (transformers' ``resize_token_embeddings`` sets
        ``out_features`` after tying the resized weight): the weight's size, which it reads."""
        size = int(self.weight.shape[dim])
        if value.__class__ is not int or value != size:
            raise ValueError(
                f"FusedLMHead.{name} is the weight's size {size} (weight shape "
                f"{tuple(self.weight.shape)}); got {value!r}: replace the weight to change it"
            )

    def extra_repr(self) -> str:
        cfg = self.head.config
        text = f"in_features={self.in_features}, out_features={self.out_features}, "
        text += f"bias={self.bias is not None}, backend={cfg.backend!r}"
        if cfg.softcap is not None:
            text += f", softcap={cfg.softcap}"
        return text

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        temperature: float | torch.Tensor | None = None,
        *,
        ignore_index: int | None = None,
        return_entropy: bool | None = None,
        softcap: float | None = None,
        check_labels: bool | None = None,
        process_group: Any = None,
        vocab_start: int | None = None,
        vocab_size: int | None = None,
        reduce_hidden_grad: bool = True,
        top_k: int | None = None,
        gather_ids: torch.Tensor | None = None,
        return_lse: bool = False,
        return_sum_p2: bool = False,
        return_argmax: bool = False,
    ) -> Any:
        """``FusedHeadOutput(log_probs, entropy)`` of ``labels`` (fp32, the labels' shape), and
        the further outputs asked for (``top_k``, ``gather_ids``, ``return_*``: docs/distillation.md).

        Without ``labels`` it behaves as the ``nn.Linear`` it replaced and returns the logits
        ``hidden @ W.T + b`` (for generation or evaluation code that calls ``lm_head(h)``).
        Arguments left as None take the config's defaults.
        """
        weight, bias = self.weight, self.bias
        if is_dtensor(weight):
            raise RuntimeError(
                "FusedLMHead.weight is a DTensor inside forward, so FSDP2 did not unshard it: call the "
                "module (head(h, labels)), not head.forward(...), and make sure it was part of the model "
                "when fully_shard was applied (fully_shard the head itself or a parent module that "
                "contains it, e.g. the root for tied embeddings)"
            )
        if labels is None:
            _logits_only(
                temperature=temperature,
                ignore_index=ignore_index,
                return_entropy=return_entropy,
                softcap=softcap,
                check_labels=check_labels,
                process_group=process_group,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
                reduce_hidden_grad=None if reduce_hidden_grad is True else reduce_hidden_grad,
                top_k=top_k,
                gather_ids=gather_ids,
                return_lse=return_lse or None,
                return_sum_p2=return_sum_p2 or None,
                return_argmax=return_argmax or None,
            )
            return nn.functional.linear(_linear_input(hidden, weight), weight, bias)
        # In the call, not a local: locals() is the arguments (and weight, bias) alone.
        return owned(head_forward(self.head, head_request(locals(), self.head.config), bias))


def _logits_only(**given: object) -> None:
    """Without labels the head is the ``nn.Linear`` it replaced: a fused call's argument given
    there (``head(h, None, 0.7)``, ``head(h, top_k=5)``) was dropped and the raw logits returned."""
    named = [f"{k}={v!r}" for k, v in given.items() if v is not None]
    if named:
        raise TypeError(
            "FusedLMHead called without labels returns the logits, as nn.Linear does, and takes "
            f"no argument of a fused call: got {', '.join(named)}; pass labels for the fused "
            "call, or apply it to the logits yourself"
        )


def _linear_input(hidden: object, weight: torch.Tensor) -> torch.Tensor:
    """``hidden`` checked for the logits path as a call checks it (shape, dtype, device), so a
    mismatch is named instead of failing in the matmul ('mat1 and mat2 shapes cannot be
    multiplied'); under autocast the dtypes may differ, and a sparse hidden is taken, as by
    ``nn.Linear``."""
    if not isinstance(hidden, torch.Tensor) or hidden.is_nested:
        tensor_arg("hidden", hidden)  # the call's TypeError
    h: torch.Tensor = hidden  # type: ignore[assignment]
    if h.dim() == 0 or h.shape[-1] != weight.shape[1]:
        raise width_mismatch(tuple(h.shape), tuple(weight.shape))
    if h.device != weight.device:
        raise ValueError(f"hidden must be on the weight's device {weight.device}, got {h.device}")
    if not h.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got dtype {h.dtype}")
    if h.dtype != weight.dtype:
        try:
            autocast = torch.is_autocast_enabled(h.device.type)
        except RuntimeError:  # a device type autocast does not know (meta)
            autocast = False
        if not autocast:
            raise TypeError(
                f"hidden and weight must share a dtype outside torch.autocast, got hidden "
                f"{h.dtype} and weight {weight.dtype}; cast one of them or call inside "
                "torch.autocast"
            )
    return h


def owned(out: FusedHeadOutput) -> FusedHeadOutput:
    """Outputs that are not views (a copy of each that is one: N floats, N k for top-k).

    FSDP2 hooks its pre-backward all-gather onto a module's outputs; an in-place op on an output
    that is a view would drop that hook, so FSDP2 warns about view outputs. The core returns
    views (the reshape to the labels' shape), hence this.
    """
    compiling = torch.compiler.is_compiling()  # `_is_view` does not trace: copy either way

    def own(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else (t.clone() if compiling or t._is_view() else t)

    lp, ent = out
    extras = {name: own(getattr(out, name)) for name in _EXTRA_OUTPUTS}
    return FusedHeadOutput(own(lp), own(ent), **extras)  # type: ignore[arg-type]


#: ``FusedHeadOutput``'s attributes past ``(log_probs, entropy)``, carried through ``owned``.
_EXTRA_OUTPUTS = ("lse", "sum_p2", "argmax", "topk_ids", "topk_log_probs", "gathered")


def head_forward(
    head: FusedHead, request: HeadRequest, bias: torch.Tensor | None = None
) -> FusedHeadOutput:
    """``head`` on ``request`` with ``hidden @ weight.T + bias``; a bias is folded in as one
    more column of hidden and weight.

    Everything the fold reads is checked first, against what the caller passed: an error after
    the fold would name the folded shapes (``H + 1``), which the caller never built."""
    if bias is not None:
        try:
            request = _fold_bias(request, bias)
        except Exception:
            shared = request.process_group is not None and request.check_labels is True
            if shared and not tracing():
                rank_agreement.refused(request.process_group, request.hidden)  # the others too
            raise
    return head.run(request)


def _fold_bias(request: HeadRequest, bias: torch.Tensor) -> HeadRequest:
    """``request`` with ``bias`` folded in as one more column of hidden and weight."""
    weight = request.weight
    # The fold reads hidden before the head validates it: its own errors name it first.
    hidden = tensor_arg("hidden", request.hidden)
    if hidden.dim() == 0:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    _check_bias(bias, weight)
    if weight.dim() == 2 and hidden.shape[-1] != weight.shape[1]:
        raise width_mismatch(tuple(hidden.shape), tuple(weight.shape))
    # [h, 1] @ [W, b].T == h @ W.T + b
    ones = hidden.new_ones((*hidden.shape[:-1], 1))
    return request._replace(
        hidden=torch.cat([hidden, ones], dim=-1),
        weight=torch.cat([weight, bias.to(weight.dtype).unsqueeze(-1)], dim=-1),
    )


def _check_bias(bias: object, weight: torch.Tensor) -> None:
    """``bias`` as the fold needs it, named as the caller set it: a floating-point ``[V]`` tensor
    on the weight's device (it may have been replaced since the module was built)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if weight.dim() == 2 and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"bias must have shape [V]=({weight.shape[0]},) to match weight "
            f"{tuple(weight.shape)}, got {tuple(bias.shape)}"
        )
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got dtype {bias.dtype}")
    if bias.device != weight.device:
        raise ValueError(f"bias must be on the weight's device {weight.device}, got {bias.device}")


def _param(t: object) -> nn.Parameter:
    if not isinstance(t, nn.Parameter):
        raise TypeError(
            f"expected the LM head's weight to be an nn.Parameter, got {type(t).__name__}"
        )
    return t


def output_head(model: nn.Module) -> nn.Linear | FusedLMHead:
    """The module producing ``model``'s logits: ``lm_head`` or ``get_output_embeddings()``."""
    head = getattr(model, "lm_head", None)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    if head is None and callable(get_output_embeddings):
        head = get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has neither an lm_head nor get_output_embeddings(); build "
            "FusedLMHead(weight_parameter, config) from the head's weight instead"
        )
    if not isinstance(head, (nn.Linear, FusedLMHead)):
        raise TypeError(
            f"{type(model).__name__}'s output head is a {type(head).__name__}, not an nn.Linear; build "
            "FusedLMHead(weight_parameter, config) from its weight instead"
        )
    return head


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder body whose last hidden state ``model``'s head scores: ``get_decoder()``, else
    ``.model``; through a wrapper's own causal LM (Llama 4's ``language_model``, whose
    ``get_decoder()`` is that LM) to its body. Never a module with an ``lm_head`` of its own,
    whose output would be logits, not hidden states."""
    body = model
    for _ in range(4):  # a wrapper, its causal LM, the body: never deeper in transformers
        get = getattr(body, "get_decoder", None)
        inner = get() if callable(get) else None
        if not isinstance(inner, nn.Module) or inner is body:
            inner = getattr(body, "model", None)
        if not isinstance(inner, nn.Module) or inner is body or inner is model:
            break
        if not isinstance(getattr(inner, "lm_head", None), nn.Module):
            return inner
        body = inner
    raise ValueError(
        f"cannot find the decoder body of {type(model).__name__} (tried get_decoder() and .model, "
        "through a causal LM inside it); pass a causal LM such as LlamaForCausalLM"
    )


def model_softcap(model: nn.Module) -> float | None:
    """``model.config.final_logit_softcapping`` when the model has one set (Gemma-2 style)."""
    return config_softcap(getattr(model, "config", None))


#: Config attributes of a ``c * tanh(z / c)`` cap on the LM head's logits: Gemma-2 and later,
#: RecurrentGemma, xLSTM (``output_logit_soft_cap``, which its forward applies in training too).
SOFTCAP_ATTRIBUTES = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def config_softcap(config: Any) -> float | None:
    """A model config's logit softcap (``SOFTCAP_ATTRIBUTES``): None, or a finite number > 0.

    Refused by its name otherwise: transformers divides by it (0 gave NaN logits there, and was
    read here as no softcap), and a str or bool was taken as a number.
    """
    attr, value = next(
        ((a, v) for a in SOFTCAP_ATTRIBUTES if (v := getattr(config, a, None)) is not None),
        (SOFTCAP_ATTRIBUTES[0], None),
    )
    return config_positive(attr, value, "no softcap")


def config_positive(attr: str, value: object, none_means: str) -> float | None:
    """``model.config.<attr>``'s ``value`` as a float: None, or a finite number > 0.

    A softcap, or a scale a model multiplies or divides its logits (or hidden states) by. A bool,
    a str (MPT's ``logit_scale='inv_sqrt_d_model'``) or any other non-number is a TypeError and 0,
    a negative number, inf or NaN a ValueError, each naming the attribute: a value taken as given
    there would give other log-probs than the model's (or a bare ``float()`` error).
    ``none_means`` says what None stands for, in the ValueError.
    """
    if value is None:
        return None
    if value.__class__ is bool or not isinstance(value, numbers.Real):
        raise TypeError(
            f"model.config.{attr} must be a number > 0 or None, got {type_name(value)} {value!r}"
        )
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(
            f"model.config.{attr} must be a finite number > 0 or None ({none_means}), got {value!r}"
        )
    return number


def _with_model_softcap(config: ConfigLike, model: nn.Module) -> ConfigLike:
    """``config`` with ``softcap`` from the model's config when the caller left it unset."""
    cap = model_softcap(model)
    if cap is None:
        return config
    if isinstance(config, FusedHead):
        return (
            config if config.config.softcap is not None else FusedHead(config.config, softcap=cap)
        )
    if isinstance(config, FusedHeadConfig):
        return (
            config
            if config.softcap is not None
            else FusedHeadConfig(**{**config.to_dict(), "softcap": cap})
        )
    data = dict(config or {})
    if data.get("softcap") is None:
        data["softcap"] = cap
    return data


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) shards ``module``: its class is public from torch 2.6,
    private in 2.4-2.5 (the core's floor); False on a torch built without distributed."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined,no-redef]
                FSDPModule,
            )
        except ImportError:
            return False
    return isinstance(module, FSDPModule)


def call_in_forward(module: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` run as ``module``'s forward when FSDP2 shards ``module``, else simply ``fn()``.

    FSDP2 unshards a module's parameters in its pre-forward hook and reshards them (and arranges
    the gradient reduce-scatter) around its forward and backward. Code that reads those parameters
    outside ``module(...)`` sees DTensors; running it as the module's forward, through
    ``module.__call__`` so every hook fires, gives it the unsharded tensors.
    """
    if not is_fsdp_module(module):
        return fn()
    return run_as_forward(module, fn)


def run_as_forward(module: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` run as ``module``'s forward through ``module.__call__``, so every hook fires."""
    # An instance attribute shadows the class's forward for this one call; restored after.
    own = module.__dict__
    had_own, previous = "forward" in own, own.get("forward")
    own["forward"] = lambda *args, **kwargs: fn()
    try:
        result: T = module()
        return result
    finally:
        if had_own:
            own["forward"] = previous
        else:
            del own["forward"]
