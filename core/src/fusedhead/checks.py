"""Argument checks shared by every call kind (head, KL, policy loss) and the modules around them.

Each names the argument, what it got and what was expected (``TypeError``/``ValueError``). They
read metadata only (types, dtypes, shapes, devices), never a tensor's values: those checks are
deferred (``fusedhead.value_checks``).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from typing import NoReturn

import torch

from fusedhead.errors import type_name
from fusedhead.protocol import SCALAR_RANGE

FLOAT_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Every float scalar of a call lies in [SCALAR_LO, SCALAR_HI] (protocol.SCALAR_RANGE).
SCALAR_LO, SCALAR_HI = SCALAR_RANGE
#: What a scalar out of that range is told, after "must be a finite float > 0".
RANGE_TEXT = (
    "in [2**-126, 2**126] (about 1.2e-38 to 8.5e37: it and its reciprocal normal fp32 numbers)"
)
#: The smallest count a loss divides by (``loss_normalizer``, ``horizon``): a token's weight
#: ``1 / (normalizer * horizon)`` is at most 2**64, so that the weighted sum over millions of
#: tokens stays far inside fp32 (at 2**-63 each, a weight of 2**126 made a loss of -inf).
COUNT_FLOOR = 2.0**-32
COUNT_TEXT = (
    "at least 2**-32 (about 2.3e-10, so that the loss's token weights, 1 over the counts it "
    "divides by, stay far inside fp32)"
)
INT_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32}
)


def not_int64_exact(arg: str, dtype: torch.dtype) -> NoReturn:
    """An id tensor of a dtype without an exact int64 form (compared with ``ignore_index`` and
    the vocabulary in int64): floats, bool, complex, and uint64 (past 2**63 it wraps negative,
    e.g. onto -100)."""
    fix = f"pass token ids, e.g. {arg}.long()" if dtype.is_floating_point else "pass int64 ids"
    raise TypeError(
        f"{arg} must be an integer tensor that converts to int64 exactly (int8 to int64, uint8 to "
        f"uint32), got dtype {dtype}: {fix}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``/``fp16``/``bf16`` for a supported dtype."""
    return FLOAT_DTYPES[dtype]


def is_dtensor(t: object) -> bool:
    """A DTensor (or subclass), known by name: no import of torch.distributed. The MRO is sliced
    because torch.compile iterates a tuple it made, not a type's own ``__mro__``."""
    return any(c.__name__ == "DTensor" for c in type(t).__mro__[:])


PLAIN = (torch.Tensor, torch.nn.Parameter)
STRIDED = torch.strided


def not_dense(arg: str, t: torch.Tensor) -> NoReturn:
    """A sparse, nested or other non-strided tensor, named (the backends index strided memory)."""
    what = "a nested tensor" if t.is_nested else f"layout {t.layout}"
    fix = f"; pass {arg}.to_dense()" if t.layout is not STRIDED and not t.is_nested else ""
    raise TypeError(f"{arg} must be a dense (torch.strided) tensor, got {what}{fix}")


def tensor_arg(arg: str, value: object) -> torch.Tensor:
    """``value`` as a plain, dense tensor, else a ``TypeError`` naming ``arg`` (a DTensor is told
    how to call under FSDP2)."""
    if value.__class__ in PLAIN:  # the common case, without walking the MRO
        t: torch.Tensor = value  # type: ignore[assignment]
        if t.layout is not STRIDED or t.is_nested:
            not_dense(arg, t)
        return t
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type_name(value)}")
    if value.layout is not STRIDED or value.is_nested:
        not_dense(arg, value)
    if is_dtensor(value):
        local = (
            f"{arg}.to_local() (rows are scored independently, so a shard of them is fine)"
            if "hidden" in arg
            else f"not {arg}.to_local(), which is only this rank's shard of the vocabulary rows"
        )
        raise TypeError(
            f"{arg} is a DTensor; fusedhead takes plain local tensors. Under FSDP2 call it inside "
            "the LM-head module's forward, where the weight is gathered (fusedhead.FusedLMHead and "
            f"fusedhead.integrations.lm_head.lm_head_logprobs do this for you); pass {local}"
        )
    return value


def positive_float(arg: str, value: object) -> float:
    """``value`` as a float in ``SCALAR_RANGE``: any real number but a bool (Python's, or a
    NumPy scalar such as a config's ``np.float32``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg} must be a float, got {type_name(value)} {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        out = math.inf
    if not SCALAR_LO <= out <= SCALAR_HI:  # NaN fails both comparisons
        value = number_shown(value)
        shown = (
            value
            if not isinstance(value, int) or abs(value) < 10**20
            else f"an int of {len(str(abs(value)))} digits"
        )
        raise ValueError(f"{arg} must be a finite float > 0 {RANGE_TEXT}, got {shown}")
    return out


def real_in(arg: str, value: object, *, low: float, high: float = math.inf, what: str) -> float:
    """``value`` as a finite float in ``[low, high)`` and within ``SCALAR_HI`` of 0 (it is used
    in fp32: 1e39 would be inf there), any real number but a bool, else a
    ``TypeError``/``ValueError`` naming ``arg``, the value and ``what`` it must be."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = (
            "; a Python number is taken here, not a tensor: pass value.item() (a host read)"
            if callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0
            else ""
        )
        raise TypeError(f"{arg} must be a float ({what}), got {type_name(value)} {value!r}{hint}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        out = math.inf
    # Finite by comparison, not math.isfinite: Dynamo cannot trace that on a symbolic float.
    if not (low <= out < high and -math.inf < out < math.inf):
        raise ValueError(f"{arg} must be {what}, got {_shown(value)}")
    if abs(out) > SCALAR_HI:
        raise ValueError(
            f"{arg} must be {what} and at most 2**126 (about 8.5e37) in magnitude, where fp32 "
            f"holds it with room to compute, got {_shown(value)}"
        )
    return out


def check_clip_low(arg: str, value: object) -> float:
    """The lower clip range ``value`` (``arg`` as the caller names it) as a finite float >= 0:
    from 1 up the bound ``1 - clip_low`` is at most 0, which no ratio is below (no lower clip;
    verl and TRL run any such value alike)."""
    return real_in(arg, value, low=0.0, what="a finite float >= 0")


def number_shown(value: object) -> object:
    """``value`` as the plain number a message formats. Under ``torch.compile`` a float or int
    argument whose value changed between calls is symbolic (Dynamo's SymFloat / SymInt), which
    Dynamo cannot format: the f-string stopped the trace with Dynamo's own error in place of the
    refusal. ``guard_scalar`` reads the number it holds, guarding the trace on it; only on the
    way to a refusal, so a good value's graph stays general. Eagerly, ``value`` itself."""
    if torch.compiler.is_compiling() and isinstance(
        value, (int, float, torch.SymInt, torch.SymFloat)
    ):
        from torch.fx.experimental.symbolic_shapes import guard_scalar  # loaded by Dynamo

        return guard_scalar(value)
    return value


def _shown(value: object) -> str:
    """``value`` for a message: an int of hundreds of digits by its length."""
    value = number_shown(value)
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an int of {len(str(abs(value)))} digits"
    return repr(value)


def integer(arg: str, value: object, expected: str) -> int:
    """``value`` as an int: any integer but a bool (Python's, or a NumPy integer such as a
    config's ``np.int64``, as ``operator.index`` takes it)."""
    if value.__class__ is int:
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg} must be {expected}, got {type_name(value)} {value!r}")
    return int(value)


def per_token_shape(arg: str, t: torch.Tensor, shape: tuple[int, ...], per_sequence: bool) -> None:
    """A per-token tensor must have the labels' ``shape`` (with ``per_sequence``, also
    ``[..., 1]``: one value per sequence); any other broadcast would spread values silently."""
    got = tuple(t.shape)
    one_per_sequence = (*shape[:-1], 1) if per_sequence and len(shape) >= 2 else None
    if got != shape and got != one_per_sequence:
        also = f" or {one_per_sequence} (one value per sequence)" if one_per_sequence else ""
        raise ValueError(f"{arg} must have the labels' shape {shape}{also}, got {got}")


def width_mismatch(
    hidden_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    *,
    hidden: str = "hidden",
    weight: str = "weight",
) -> ValueError:
    """The error of a hidden state whose width is not the weight's ``H`` (the weight is
    ``[V, H]``), saying so where the weight looks transposed (its ``V`` is hidden's width)."""
    text = (
        f"{hidden}'s last dimension must equal {weight}'s H={weight_shape[1]}, got {hidden} shape "
        f"{hidden_shape} ({weight} is [V, H]: shape {weight_shape})"
    )
    if hidden_shape and weight_shape[0] == hidden_shape[-1]:
        text += (
            f"; {weight} looks transposed: pass the LM head's weight as [V, H] (lm_head.weight, "
            "not its .T)"
        )
    return ValueError(text)


def sequences_marked(aggregation: str, shape: tuple[int, ...], cu_seqlens: object) -> None:
    """A mean over sequences needs them marked: labels ``[B, S]`` (a row each) or ``cu_seqlens``.
    Flat ``[N]`` labels without them would be one sequence, silently (an empty batch has none)."""
    n = math.prod(shape)
    if aggregation != "token-mean" and len(shape) == 1 and n and cu_seqlens is None:
        raise ValueError(
            f"aggregation={aggregation!r} averages over sequences, and flat labels {list(shape)} "
            "without cu_seqlens mark none: pass labels [B, S] (one sequence a row), labels [T] "
            f"or [1, T] with cu_seqlens for a packed batch, or labels [1, {n}] for one sequence"
        )


def packed_per_sequence(
    arg: str, t: torch.Tensor, cu_seqlens: object, shape: tuple[int, ...]
) -> None:
    """Beside packed ``[1, T]`` labels (``cu_seqlens``), a ``[k, 1]`` tensor is no value per
    sequence as ``[B, 1]`` is beside ``[B, S]``: ``[1, 1]`` would spread one value over every
    sequence. Refused (a single sequence aside), with the spread that was likely meant."""
    seqs = cu_seqlens.numel() - 1 if isinstance(cu_seqlens, torch.Tensor) else None
    per_sequence_shape = len(shape) == 2 and t.dim() == 2 and t.shape[1] == 1
    if per_sequence_shape and tuple(t.shape) != shape and seqs != 1:
        raise ValueError(
            f"{arg} of shape {tuple(t.shape)} beside packed labels {shape} (cu_seqlens of "
            f"{seqs} sequences) would not give one value per sequence; pass one per token, "
            f"e.g. per-sequence values A [{seqs}] as A.repeat_interleave(cu_seqlens.diff())[None]"
        )


def one_element_real(arg: str, t: torch.Tensor) -> None:
    """A tensor standing for one real number (``loss_normalizer``): not bool or complex, one
    element."""
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(
            f"{arg} must be a number or a one-element real (float or integer) tensor, got a "
            f"tensor of dtype {t.dtype}"
        )
    if t.numel() != 1:
        raise ValueError(
            f"{arg} must be a number or a one-element tensor, got a tensor of shape "
            f"{tuple(t.shape)}"
        )


def per_token_rank(arg: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Refuse a per-token tensor of another number of dimensions than the labels' ``shape``
    (one element aside): torch would broadcast ``[B]`` beside ``[B, S]`` along S, silently, where
    B == S or where either is 1. ``what`` names the argument's role in the message."""
    if t.dim() != len(shape) and t.numel() != 1:
        raise ValueError(
            f"{what} of shape {tuple(t.shape)} must have the labels' number of dimensions "
            f"(labels {tuple(shape)}; [B, 1] for one value per sequence) or one element"
        )


def no_inference_tensor(*named: tuple[str, torch.Tensor]) -> None:
    """Refuse an inference tensor where a gradient is due: autograd cannot save it for backward
    (torch's own RuntimeError, raised deep inside a backend, names no argument)."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace is_inference() (a graph break)
        return
    for arg, t in named:
        if t.is_inference():
            raise ValueError(
                f"{arg} is an inference tensor (made under torch.inference_mode()), which autograd "
                "cannot save for the gradient this call owes (hidden or weight "
                f"requires grad); make it under torch.no_grad() instead, pass {arg}.clone(), or "
                "call under torch.no_grad() where no gradient is wanted"
            )


def saveable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where it is an inference tensor (token ids sampled under
    ``torch.inference_mode()``): a backend saves labels, ids and temperatures for its backward,
    which autograd refuses for an inference tensor. They are small and never differentiated, so
    a copy serves (hidden and weight are refused instead: their gradient must reach them)."""
    if torch.compiler.is_compiling() or not t.is_inference():  # is_inference(): no trace
        return t
    return t.clone()


def flag_arg(arg: str, value: object) -> bool:
    """``value`` if it is a bool (a truthy str or 0 must not pick a behaviour silently)."""
    if value is True or value is False:
        return value
    raise TypeError(f"{arg} must be a bool, got {type_name(value)} {value!r}")


def not_a_flag(arg: str, value: object) -> NoReturn:
    """The ``TypeError`` of a flag that is not a bool."""
    raise TypeError(f"{arg} must be a bool, got {type_name(value)} {value!r}")


#: Per device: its type and whether ``torch.is_autocast_enabled`` knows that type (not meta).
#: ``device.type`` builds a new str on every read (slow, per call); devices are few.
DEVICES: dict[torch.device, tuple[str, bool]] = {}


def device_entry(dev: torch.device) -> tuple[str, bool]:
    """The first call on ``dev``: its type, and whether autocast has a state for it."""
    dev_type = dev.type
    try:
        torch.is_autocast_enabled(dev_type)
        known = True
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        known = False
    entry = DEVICES[dev] = (dev_type, known)
    return entry


#: Device types every process can use: tensors there need no accelerator.
_ALWAYS_USABLE = frozenset({"cpu", "meta"})


def device_arg(arg: str, value: object) -> torch.device:
    """``value`` (a ``torch.device`` or a device string) as a ``torch.device``, availability not
    checked; else a ``ValueError``/``TypeError`` naming ``arg`` (torch's own RuntimeError names
    no argument, and reads an int as an accelerator's index)."""
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{arg} must be a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', "
            f"got {type_name(value)} {value!r}"
        )
    try:
        return torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{arg} must be a torch device string such as 'cpu', 'cuda' or 'cuda:1', got {value!r}"
        ) from None


def usable_device(value: str, arg: str = "device") -> torch.device:
    """``value`` as a ``torch.device`` this process can use, else a ``ValueError`` naming ``arg``.

    ``cpu`` and ``meta`` always; ``cuda`` / ``cuda:K`` where torch sees CUDA and K is below
    ``torch.cuda.device_count()``; another accelerator type (``xpu``, ``mps``, ...) where its
    torch module says it is available, likewise by index. Run once, where a head is resolved.
    """
    expected = "expected 'cpu', 'meta' or an accelerator device this process sees"
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(
            f"{arg}={value!r} is not a torch device string; {expected}, such as 'cuda' or 'cuda:1'"
        ) from None
    kind = dev.type
    if kind in _ALWAYS_USABLE:
        return dev
    module = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available) or not is_available():
        why = (
            f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
            if kind == "cuda"
            else f"torch {torch.__version__} has no usable {kind!r} device here"
        )
        raise ValueError(f"{arg}={value!r} cannot be used in this process: {why}; {expected}")
    count = getattr(module, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        n = count()
        raise ValueError(
            f"{arg}={value!r} cannot be used in this process: torch.{kind}.device_count() is {n} "
            f"(indices 0..{n - 1}); {expected}"
        )
    return dev


def did_you_mean(value: object, names: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``names`` to a str ``value`` (a case-only
    difference first: ``"K3"``, ``"Token-Mean"``), or ``""``."""
    if not isinstance(value, str):
        return ""
    names = list(names)
    close = [n for n in names if n.lower() == value.lower()]
    close = close or difflib.get_close_matches(value, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
