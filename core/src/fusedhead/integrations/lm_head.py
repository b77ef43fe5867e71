"""Score already-shifted labels from a trainer's own LM-head module and hidden states.

RL trainers (verl, VeOmni, OpenRLHF, TRL) run their decoder themselves and hold the last hidden
states, packed ``[1, total, H]`` (remove-padding) or padded ``[B, T, H]``, with labels already
rolled so that ``labels[..., t]`` is the token position ``t`` predicts. ``lm_head_logprobs`` turns
those into per-token log-probs and entropies without forming ``[tokens, vocab]`` logits:

- the LM head's weight (and bias) is read inside that module's own call, so FSDP2
  (``fully_shard``) and ZeRO-3 style parameter hooks gather it as they would for ``lm_head(h)``;
- only the scored rows (``label != ignore_index``) reach the backend; ignored rows give 0 and no
  gradient;
- the backend is the one named (a ``FusedHead``, a ``FusedHeadConfig``, a mapping or a name), and
  every resolution goes through ``FusedHead``, which fires the ``fusedhead_backend_resolved`` hook.

Which backend a trainer's setting names, and the spellings ``"fusedhead"`` /
``"fusedhead:<name>"``, is :mod:`fusedhead.integrations.backend_spec`; what a model does to its
logits after its decoder is :mod:`fusedhead.integrations.logit_transforms` (``__all__`` below
re-exports the names trainers' glue imports from here).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from fusedhead.api import FusedHead, FusedHeadOutput
from fusedhead.checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    RANGE_TEXT,
    SCALAR_HI,
    SCALAR_LO,
    is_dtensor,
    per_token_rank,
)
from fusedhead.integrations.backend_spec import (
    SPEC_PREFIX,
    HeadLike,
    check_head_runs_on,
    installed_backend_names,
    is_fusedhead_spec,
    parse_backend_spec,
    resolve_lm_head,
    spelled,
)
from fusedhead.integrations.logit_transforms import model_logit_transform
from fusedhead.module import (
    call_in_forward,
    head_forward,
    owned,
    run_as_forward,
)
from fusedhead.policy_output import PolicyLossOutput
from fusedhead.request import output_flags
from fusedhead.value_checks import (
    Pending,
    check_gather_range,
    check_label_range,
    check_temperature_values,
)

__all__ = [
    "SPEC_PREFIX",
    "HeadLike",
    "check_head_runs_on",
    "installed_backend_names",
    "is_fusedhead_spec",
    "lm_head_logprobs",
    "lm_head_policy_loss",
    "model_logit_transform",
    "parse_backend_spec",
    "resolve_lm_head",
    "spelled",
]

T = TypeVar("T")


def lm_head_logprobs(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    head: HeadLike = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    select_rows: bool = True,
    in_call: bool = True,
    gather_ids: torch.Tensor | None = None,
    return_sum_p2: bool = False,
    return_argmax: bool = False,
    on_weight: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
) -> FusedHeadOutput:
    """Log-prob of each already-shifted label and entropy of each row, fp32 in ``labels``' shape.

    ``lm_head``: an ``nn.Linear``, a ``FusedLMHead`` or any module with a ``weight [V, H]`` (and
    optionally ``bias [V]``), e.g. a tied ``nn.Embedding``. ``hidden [..., H]`` (packed
    ``[1, total, H]`` or padded ``[B, T, H]``), ``labels`` of ``hidden``'s leading shape, already
    rolled by the trainer; rows equal to ``ignore_index`` give 0 and zero gradient.
    ``temperature``: a float or a tensor broadcastable to ``labels`` (per token or ``[B, 1]`` per
    sample); ``softcap`` defaults to the head config's; ``logit_scale`` multiplies the logits
    before the softcap (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``).
    ``compute_dtype`` casts hidden, weight and bias to one dtype inside the call, outside autocast
    (e.g. float32 for an fp32 head projection); None keeps them as given (autocast applies).
    ``head`` names the backend (see :func:`resolve_lm_head`). ``select_rows=True`` sends only scored rows to the backend (one host
    sync); ``False`` sends every row, sync-free, for CUDA graphs and ``torch.compile``.
    ``in_call=False`` reads the weight directly, for a caller that already runs inside
    ``lm_head``'s forward (one that stands in for it during the model's own call).
    ``gather_ids [..., K]`` (a teacher's top-k ids): ``out.gathered [..., K]``, the log-probs at
    those ids, differentiable, 0 on ignored rows (top-k distillation). The ``return_*`` flags ask
    for the outputs they name: ``out.sum_p2`` (sum of squared probabilities, 0 on ignored rows)
    and ``out.argmax`` (the most likely id, the lower on ties; -1 on ignored rows). ``on_weight`` is
    called with the ``(weight, bias)`` read inside the call (gathered, as given: before
    ``compute_dtype`` and ``logit_scale``), for a statistic of the head under the same gather.
    """
    # The output flags asked for, by their names in the signature, as given (validate names a
    # non-bool). First, and no closure in this function: Dynamo reads locals() only where every
    # closure cell is set.
    flags = output_flags(locals())
    weight_of = _check_lm_head(lm_head)
    _check_inputs(hidden, labels, ignore_index, return_entropy, select_rows, in_call)
    _check_gather_ids(gather_ids, labels)
    if on_weight is not None and not callable(on_weight):
        raise TypeError(
            "on_weight must be a callable taking (weight, bias) or None, got "
            f"{type(on_weight).__name__} {on_weight!r}"
        )
    scale = _logit_scale(logit_scale)
    _check_compute_dtype(compute_dtype)
    fused = resolve_lm_head(head, lm_head)
    temp = _temperature(temperature, labels, hidden.device)
    shape = tuple(labels.shape)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    flat_temp: float | torch.Tensor = temp
    if isinstance(temp, torch.Tensor):
        # Values at ignored rows are never used: keep them out of the core's validation.
        flat_temp = torch.where(valid, temp.reshape(-1), 1.0)
    options: dict[str, Any] = {
        "ignore_index": ignore_index,
        "return_entropy": return_entropy,
        "softcap": softcap,
        **flags,
    }
    flat_gather = None if gather_ids is None else gather_ids.reshape(flat_labels.shape[0], -1)
    rows = None
    if select_rows:
        rows = valid.nonzero().squeeze(1)  # one host sync; ignored rows never reach the backend
        t = flat_temp.index_select(0, rows) if isinstance(flat_temp, torch.Tensor) else flat_temp
        g = None if flat_gather is None else flat_gather.index_select(0, rows)
        h, y = flat_hidden.index_select(0, rows), flat_labels.index_select(0, rows)
    else:
        h, y, t, g = flat_hidden, flat_labels, flat_temp, flat_gather
    out = _score(
        lm_head,
        fused,
        weight_of,
        options if g is None else {**options, "gather_ids": g},
        (h, y, t),
        on_weight=on_weight,
        compute_dtype=compute_dtype,
        scale=scale,
        in_call=in_call,
        hidden_shape=tuple(hidden.shape),
        # With rows selected, the value checks read the caller's tensors (their errors name the
        # caller's positions, not the selected rows'); the head then checks nothing again.
        full=None if rows is None else (flat_labels, flat_temp, flat_gather, ignore_index),
    )
    n = flat_labels.shape[0]
    log_probs = _place(out.log_probs, 0.0, shape, rows, n)
    assert log_probs is not None
    result = FusedHeadOutput(
        log_probs,
        _place(out.entropy, 0.0, shape, rows, n),
        sum_p2=_place(out.sum_p2, 0.0, shape, rows, n),
        argmax=_place(out.argmax, -1, shape, rows, n),
        gathered=_place(out.gathered, 0.0, shape, rows, n),
    )
    return result if select_rows else owned(result)  # index_put's outputs are fresh tensors


def _score(
    lm_head: nn.Module,
    fused: FusedHead,
    weight_of: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    options: dict[str, Any],
    rows: tuple[torch.Tensor, torch.Tensor, float | torch.Tensor],
    *,
    on_weight: Callable[[torch.Tensor, torch.Tensor | None], None] | None,
    compute_dtype: torch.dtype | None,
    scale: float,
    in_call: bool,
    hidden_shape: tuple[int, ...],
    full: tuple[torch.Tensor, float | torch.Tensor, torch.Tensor | None, int] | None = None,
) -> FusedHeadOutput:
    """The head call of ``lm_head_logprobs`` on the rows given (hidden, labels, temperature),
    inside ``lm_head``'s own call when ``in_call``: parameter-gathering hooks (FSDP2, ZeRO-3)
    have run when the weight is read. ``hidden_shape``: the caller's, for the errors; ``full``:
    the caller's flat labels, temperature, gather ids and ignore_index, whose values are checked
    here (when the head checks values) instead of the selected rows'."""
    h, y, t = rows

    def body() -> FusedHeadOutput:
        weight, bias = weight_of()
        if on_weight is not None:
            on_weight(weight, bias)
        if hidden_shape[-1] != weight.shape[1]:  # named as the caller passed it, not flattened
            raise ValueError(
                f"hidden's last dimension must equal lm_head's weight H={weight.shape[1]} (weight "
                f"shape {tuple(weight.shape)}), got hidden shape {hidden_shape}"
            )
        opts = options
        if full is not None and fused.config.check_labels and _check_values(full, weight):
            opts = {**options, "check_labels": False}  # checked above, on the caller's tensors
        h_ = h
        if compute_dtype is not None:
            weight, h_ = weight.to(compute_dtype), h.to(compute_dtype)
            bias = None if bias is None else bias.to(compute_dtype)
        if scale != 1.0:  # s * (h @ W.T + b) == (s * h) @ W.T + s * b
            h_ = h_ * scale
            bias = None if bias is None else bias * scale
        request = fused.request(h_, weight, y, temperature=t, **opts)
        if compute_dtype is None:
            return head_forward(fused, request, bias)
        with torch.autocast(h_.device.type, enabled=False):
            return head_forward(fused, request, bias)

    return in_module_call(lm_head, body) if in_call else body()


def _check_values(
    full: tuple[torch.Tensor, float | torch.Tensor, torch.Tensor | None, int], weight: torch.Tensor
) -> bool:
    """The head's value checks (label range, per-token temperatures, gather ids) on the caller's
    flat tensors, in one host read; False where they cannot run here (a dtype the head refuses by
    type, a compiled graph): the head then checks the rows it gets."""
    labels, temp, ids, ignore_index = full
    if torch.compiler.is_compiling() or labels.dtype not in INT_DTYPES or weight.dim() != 2:
        return False
    if ids is not None and ids.dtype not in INT_DTYPES:
        return False
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        return False
    vocab = weight.shape[0]
    pending = Pending()
    labels = labels.to(torch.int64)
    check_label_range(labels, ignore_index, vocab, pending)
    if isinstance(temp, torch.Tensor):
        check_temperature_values(temp.to(torch.float32), "temperature", pending)
    if ids is not None:
        check_gather_range(ids.to(torch.int64), labels, ignore_index, vocab, pending)
    pending.send()
    pending.settle()
    return True


def _place(
    x: torch.Tensor | None, fill: float, shape: tuple[int, ...], rows: torch.Tensor | None, n: int
) -> torch.Tensor | None:
    """An output of the scored rows in the labels' shape: without row selection (``rows`` None)
    a view, which ``owned`` makes the caller's; else ``fill`` where no row was scored."""
    if x is None:
        return None
    if rows is None:
        return x.reshape(*shape, *x.shape[1:])
    full = x.new_full((n, *x.shape[1:]), fill)
    return full.index_put((rows,), x).reshape(*shape, *x.shape[1:])


_LOG = logging.getLogger(__name__)
#: The LM heads whose fused policy loss has been announced (once each, at INFO).
_ANNOUNCED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _announce(lm_head: nn.Module, head: FusedHead, loss: Mapping[str, Any]) -> None:
    """Log once per LM head, at INFO, that a trainer's loss runs inside the head: where a
    trainer's own settings switch it on, this line is how a user sees that they took."""
    if lm_head in _ANNOUNCED or not _LOG.isEnabledFor(logging.INFO):
        return
    _ANNOUNCED.add(lm_head)
    where = head.distribution or "registered in-process"
    _LOG.info(
        "the policy loss of %s runs inside the head: fused_policy_loss on backend %r (%s), "
        "aggregation %r; three GEMMs per token chunk, no [tokens, vocab] logits held",
        type(lm_head).__name__,
        head.name,
        where if head.version is None else f"{where} {head.version}",
        loss.get("aggregation", "token-mean"),
    )


def lm_head_policy_loss(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    head: HeadLike = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    in_call: bool = True,
    **loss: Any,
) -> PolicyLossOutput:
    """``FusedHead.policy_loss`` of already-shifted ``labels`` from a trainer's LM-head module.

    The fused PPO/GRPO loss (docs/policy-loss.md) where a trainer holds the hidden states and the
    LM-head module: the weight is read inside the module's own call (FSDP2 / ZeRO-3 gather it
    there), ``logit_scale`` and ``compute_dtype`` apply as in :func:`lm_head_logprobs`, and
    ``loss`` holds ``policy_loss``'s keywords (``old_log_probs``, ``advantages``, ``clip_low``,
    ...). A head with a bias is refused: the fused loss takes none.
    """
    weight_of = _check_lm_head(lm_head)
    _check_inputs(hidden, labels, loss.get("ignore_index", -100), True, True, in_call)
    scale = _logit_scale(logit_scale)
    _check_compute_dtype(compute_dtype)
    fused = resolve_lm_head(head, lm_head)
    temp = _temperature(temperature, labels, hidden.device)

    def body() -> PolicyLossOutput:
        weight, bias = weight_of()
        if bias is not None:
            raise ValueError(
                f"lm_head ({type(lm_head).__name__}) has a bias; the fused policy loss takes "
                "none: score with lm_head_logprobs and write the loss in torch"
            )
        h = hidden
        if compute_dtype is not None:
            weight, h = weight.to(compute_dtype), h.to(compute_dtype)
        if scale != 1.0:  # s * (h @ W.T) == (s * h) @ W.T
            h = h * scale
        if compute_dtype is None:
            return fused.policy_loss(h, weight, labels, temperature=temp, softcap=softcap, **loss)
        with torch.autocast(h.device.type, enabled=False):
            return fused.policy_loss(h, weight, labels, temperature=temp, softcap=softcap, **loss)

    out = in_module_call(lm_head, body) if in_call else body()
    _announce(lm_head, fused, loss)
    return out


def in_module_call(module: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` run as ``module``'s forward, through ``module.__call__``, so its hooks fire.

    FSDP2 goes through ``call_in_forward``. Any other module with forward hooks (DeepSpeed
    ZeRO-3 registers pre-forward hooks that gather a partitioned weight and post-forward hooks
    that release it) gets the same treatment here; a module without hooks just runs ``fn()``.
    """
    if not _has_forward_hooks(module):
        return call_in_forward(module, fn)
    return run_as_forward(module, fn)


def _has_forward_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_mod

    own = bool(module._forward_pre_hooks or module._forward_hooks)
    glob = bool(
        getattr(module_mod, "_global_forward_pre_hooks", None)
        or getattr(module_mod, "_global_forward_hooks", None)
    )
    return own or glob


def _check_lm_head(
    lm_head: object,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
    """A reader of ``(weight, bias)`` for the LM-head module, called inside its forward."""
    if not isinstance(lm_head, nn.Module):
        raise TypeError(
            "lm_head must be an nn.Module (an nn.Linear, a FusedLMHead or a module with a .weight "
            f"[V, H]), got {type(lm_head).__name__}"
        )
    if not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        raise TypeError(
            f"lm_head {type(lm_head).__name__} has no .weight tensor; expected an nn.Linear, a "
            "FusedLMHead or a module with a .weight [V, H]"
        )
    name = type(lm_head).__name__

    def read() -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = lm_head.weight
        if is_dtensor(weight):
            raise RuntimeError(
                f"lm_head ({name}) .weight is still a DTensor inside its own call, so FSDP2 did not "
                "unshard it: fully_shard the LM head itself or a parent module that contains it"
            )
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"lm_head ({name}) .weight must have shape [V, H], got {got}")
        bias = getattr(lm_head, "bias", None)
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(
                f"lm_head ({name}) .bias must be a tensor or None, got {type(bias).__name__}"
            )
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"lm_head ({name}) .bias must have shape [V]=({weight.shape[0]},), "
                f"got {tuple(bias.shape)}"
            )
        return weight, bias

    return read


def _check_inputs(
    hidden: object,
    labels: object,
    ignore_index: object,
    return_entropy: object,
    select: object,
    in_call: object,
) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor [..., H], got {type(hidden).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"labels must be a torch.Tensor of hidden's leading shape, got {type(labels).__name__}"
        )
    if hidden.dim() < 2:
        raise ValueError(
            f"hidden must have shape [..., H] with at least 2 dims (packed [1, total, H] or padded "
            f"[B, T, H]), got shape {tuple(hidden.shape)}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])} (already shifted), "
            f"got shape {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.device != hidden.device:
        raise ValueError(f"labels must be on hidden's device {hidden.device}, got {labels.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(
            f"ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}"
        )
    for arg, value in (
        ("return_entropy", return_entropy),
        ("select_rows", select),
        ("in_call", in_call),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{arg} must be a bool, got {type(value).__name__} {value!r}")


def _check_gather_ids(gather_ids: object, labels: torch.Tensor) -> None:
    """``gather_ids`` is None or integer ids ``[*labels.shape, K]`` on the labels' device."""
    if gather_ids is None:
        return
    if not isinstance(gather_ids, torch.Tensor):
        raise TypeError(
            f"gather_ids must be a torch.Tensor [..., K] or None, got {type(gather_ids).__name__}"
        )
    if tuple(gather_ids.shape[:-1]) != tuple(labels.shape) or gather_ids.dim() != labels.dim() + 1:
        raise ValueError(
            f"gather_ids must have shape [*labels.shape, K] = [{', '.join(map(str, labels.shape))}"
            f", K], got {tuple(gather_ids.shape)}"
        )
    if gather_ids.device != labels.device:
        raise ValueError(
            f"gather_ids must be on the labels' device {labels.device}, got {gather_ids.device}"
        )


def _check_compute_dtype(compute_dtype: object) -> None:
    """``compute_dtype`` None or a dtype a head computes in: another dtype was cast onto hidden,
    weight and bias and then refused under their names, which the caller never passed."""
    if compute_dtype is None:
        return
    if not isinstance(compute_dtype, torch.dtype):
        raise TypeError(
            f"compute_dtype must be a torch.dtype or None, got {type(compute_dtype).__name__} "
            f"{compute_dtype!r}"
        )
    if compute_dtype not in FLOAT_DTYPES:
        raise TypeError(
            "compute_dtype must be torch.float32, torch.float16 or torch.bfloat16 (or None), "
            f"got {compute_dtype}"
        )


def _logit_scale(value: object) -> float:
    """A finite non-zero float whose magnitude is a normal fp32 number (beyond 2**126 the scaled
    hidden overflows to inf and every row is NaN; below 2**-126 it flushes to 0 and every row is
    the uniform distribution: both without an error before)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"logit_scale must be a float, got {type(value).__name__} {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond any float
        out = math.inf
    if not SCALAR_LO <= abs(out) <= SCALAR_HI:  # NaN fails both comparisons
        shown = value if abs(out) < math.inf or isinstance(value, float) else "an int beyond fp32"
        raise ValueError(
            f"logit_scale must be a finite non-zero float whose magnitude is {RANGE_TEXT}, got "
            f"{shown!r}"
        )
    return out


def _temperature(value: object, labels: torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A float as is (the core checks it); a tensor broadcast to ``labels``' shape."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"temperature must be a float or a tensor of the labels' shape, got "
                f"{type(value).__name__} {value!r}"
            )
        return float(value)
    if not value.dtype.is_floating_point:
        raise TypeError(f"temperature tensor must be floating point, got dtype {value.dtype}")
    if value.device != device:
        raise ValueError(
            f"temperature tensor must be on hidden's device {device}, got {value.device}"
        )
    per_token_rank("temperature", value, tuple(labels.shape), "temperature tensor")
    try:
        return torch.broadcast_to(value, labels.shape)
    except RuntimeError:
        raise ValueError(
            f"temperature tensor of shape {tuple(value.shape)} must broadcast to the labels' shape "
            f"{tuple(labels.shape)} (per token, or [B, 1] per sample)"
        ) from None
