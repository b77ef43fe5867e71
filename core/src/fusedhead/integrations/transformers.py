"""Next-token log-probs and entropy of a Hugging Face causal LM without ``[N, V]`` logits.

``causal_lm_logprobs(model, input_ids, attention_mask)`` is what an RL trainer (verl, TRL,
OpenRLHF) computes for its policy and reference models: position ``t`` scores token ``t + 1``
under the model's next-token distribution. It runs the model's decoder body for the last hidden
states and hands them with the LM-head weight to a fused head; the logits are never formed.

Needs ``transformers`` only for the model passed in (``pip install 'fusedhead[transformers]'``);
this module imports nothing from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusedhead.api import FusedHead, FusedHeadOutput
from fusedhead.checks import (
    INT64_MAX,
    INT64_MIN,
    INT_DTYPES,
    flag_arg,
    integer,
    not_int64_exact,
    tensor_arg,
)
from fusedhead.integrations.backend_spec import HeadLike, resolve_lm_head
from fusedhead.integrations.logit_transforms import model_logit_transform
from fusedhead.module import (
    FusedLMHead,
    call_in_forward,
    decoder_body,
    head_forward,
    output_head,
    owned,
)
from fusedhead.value_checks import check_temperature_values

__all__ = ["causal_lm_logprobs", "shifted_labels"]


def shifted_labels(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Labels of a causal LM: ``labels[:, t] = input_ids[:, t + 1]``, int64.

    The last position has no next token, and a position is ignored (``ignore_index``) when it or
    the token it predicts is padding (``attention_mask == 0``): that covers left and right padding.
    The labels are int64 whatever the ids' dtype: in uint8 ids ``-100`` would wrap to token 156.
    """
    ids = tensor_arg("input_ids", input_ids)
    if ids.dtype not in INT_DTYPES:
        not_int64_exact("input_ids", ids.dtype)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got shape {tuple(ids.shape)}")
    if ignore_index.__class__ is not int:
        ignore_index = integer("ignore_index", ignore_index, "an int")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    labels = torch.full(ids.shape, ignore_index, dtype=torch.int64, device=ids.device)
    labels[:, :-1] = ids[:, 1:]
    if attention_mask is not None:
        attention_mask = tensor_arg("attention_mask", attention_mask)
        if tuple(attention_mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"attention_mask must have input_ids' shape {tuple(ids.shape)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        keep = attention_mask.bool()
        valid = torch.zeros_like(keep)
        valid[:, :-1] = keep[:, :-1] & keep[:, 1:]
        labels = labels.masked_fill(~valid, ignore_index)
    return labels


def causal_lm_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    temperature: float | torch.Tensor = 1.0,
    config: HeadLike = None,
    return_entropy: bool = True,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    pack: bool = True,
    **model_kwargs: Any,
) -> FusedHeadOutput:
    """Per-token log-prob of the next token and entropy of the next-token distribution, ``[B, T]`` fp32.

    ``log_probs[b, t] = log p(input_ids[b, t + 1] | input_ids[b, :t + 1])`` under
    ``softcap(logits) / temperature``; the last position and padding positions give 0 (and no
    gradient). ``temperature`` is a float or a tensor broadcastable to ``input_ids`` (per sample:
    ``[B, 1]``); its value at position ``t`` scales the distribution predicting token ``t + 1``.
    ``softcap`` defaults to ``model.config.final_logit_softcapping``; the model's logit scale
    (Cohere's ``logit_scale``, Granite's ``logits_scaling``) is applied as its forward applies it. ``config`` is the backend's name
    (``"triton"``), a config or a ``FusedHead`` (default: the ``torch`` backend, or a replaced
    ``lm_head``'s own head). ``position_ids`` and ``model_kwargs`` go to the decoder as they would to
    ``model(...)``. ``pack=True`` runs the head only on the scored positions (one host sync);
    ``pack=False`` keeps every position, sync-free, for CUDA graphs and ``torch.compile``.
    """
    lm_head = output_head(model)
    # a model whose lm_head was replaced (FusedLMHead) keeps that head's backend by default
    head = resolve_lm_head(config, lm_head, setting="config")
    cfg = head.config
    pack = flag_arg("pack", pack)
    _check_input_ids(model, input_ids, attention_mask, cfg.check_labels)
    labels = shifted_labels(input_ids, attention_mask, ignore_index=cfg.ignore_index)
    temp = _temperature(temperature, input_ids)
    # The model's own scale (Cohere's logit_scale, Granite's logits_scaling) and softcap, as its
    # forward applies them after the head; a transform it cannot reproduce is refused here.
    scale, model_cap = model_logit_transform(getattr(model, "config", None))
    cap = softcap if softcap is not None else model_cap
    decoder = decoder_body(model)

    def body() -> FusedHeadOutput:
        out = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **model_kwargs,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if scale != 1.0:  # s * (h @ W.T) == (s * h) @ W.T
            hidden = hidden * scale
        return _score(head, lm_head, hidden, labels, temp, cap, return_entropy, pack)

    # Under FSDP2 the root's parameters (embeddings, final norm, often the LM head) are unsharded
    # only inside the root's forward: run the body there.
    return call_in_forward(model, body)


def _score(
    head: FusedHead,
    lm_head: nn.Linear | FusedLMHead,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    softcap: float | None,
    return_entropy: bool,
    pack: bool,
) -> FusedHeadOutput:
    """The fused head on the decoder's last hidden states; outputs in ``labels``' shape."""
    ignore = head.config.ignore_index
    valid = labels != ignore
    if isinstance(temperature, torch.Tensor):
        # Values at ignored positions are never used: keep them out of the core's validation.
        temperature = torch.where(valid, temperature.to(hidden.device), 1.0)
    kwargs: dict[str, Any] = {"return_entropy": return_entropy, "softcap": softcap}

    def run(h: torch.Tensor, y: torch.Tensor, t: float | torch.Tensor) -> FusedHeadOutput:
        # The LM head's weight is read here, inside its own forward if FSDP2 shards it alone.
        return call_in_forward(
            lm_head,
            lambda: head_forward(
                head,
                head.request(h, lm_head.weight, y, temperature=t, **kwargs),
                getattr(lm_head, "bias", None),
            ),
        )

    if not pack:
        return owned(run(hidden, labels, temperature))
    if (
        isinstance(temperature, torch.Tensor)
        and head.config.check_labels
        and not torch.compiler.is_compiling()
    ):  # checked here, so that an error names the caller's position, not the packed row's
        check_temperature_values(temperature.reshape(-1).to(torch.float32), "temperature")
    where = valid.nonzero(as_tuple=True)  # one host sync; padding rows never reach the head
    t = temperature[where] if isinstance(temperature, torch.Tensor) else temperature
    out = run(hidden[where], labels[where], t)
    zeros = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    log_probs = zeros.index_put(where, out.log_probs)
    entropy = None if out.entropy is None else zeros.index_put(where, out.entropy)
    return FusedHeadOutput(log_probs, entropy)


def _check_input_ids(
    model: nn.Module, input_ids: object, attention_mask: object, check_values: bool
) -> None:
    """``input_ids`` an integer ``[B, T]`` tensor (``attention_mask`` a tensor or None) and, when
    the head checks values, every id a row of the model's input embedding (one host read): an id
    out of range raised torch's "index out of range in self" from inside the model."""
    ids = tensor_arg("input_ids", input_ids)
    if ids.dtype not in (torch.int64, torch.int32):  # what torch's embedding takes
        raise TypeError(
            f"input_ids must be int64 or int32 token ids (what an embedding takes), got dtype "
            f"{ids.dtype}: pass input_ids.long()"
        )
    if attention_mask is not None:
        tensor_arg("attention_mask", attention_mask)
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    rows = getattr(embed, "num_embeddings", None)
    if not check_values or not isinstance(rows, int) or torch.compiler.is_compiling():
        return
    bad = (ids < 0) | (ids >= rows)
    if ids.numel() and bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"input_ids must be token ids in [0, {rows}) (the model's input embedding), got "
            f"{int(ids[pos])} at position {pos} ({int(bad.sum())} id(s) out of range)"
        )


def _temperature(value: float | torch.Tensor, input_ids: torch.Tensor) -> float | torch.Tensor:
    """A float as is; a tensor broadcast to ``input_ids``' shape (the core validates the values)."""
    if not isinstance(value, torch.Tensor):
        return value
    wrong = ValueError(
        f"temperature tensor of shape {tuple(value.shape)} must broadcast to input_ids' shape "
        f"{tuple(input_ids.shape)} with as many dimensions (or hold one element); a per-sample "
        "temperature has shape [B, 1]"
    )
    if value.dim() != input_ids.dim() and value.numel() != 1:  # [B] would broadcast along T
        raise wrong
    try:
        return torch.broadcast_to(value, input_ids.shape)
    except RuntimeError:
        raise wrong from None
