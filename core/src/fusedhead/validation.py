"""Validation of a call before any backend sees it: one place, the same for every backend.

Every refusal is a ``ValueError``/``TypeError`` that names the argument, what it got and what
was expected.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from fusedhead.protocol import KL_DIRECTIONS, SCALAR_RANGE, HeadCall, KLCall

_FLOAT_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Module constants for the per-call path (a global read, not a global and an attribute).
_I64 = torch.int64
#: Every float scalar of a call lies in [_LO, _HI] (protocol.SCALAR_RANGE).
_LO, _HI = SCALAR_RANGE
#: What a scalar out of that range is told, after "must be a finite float > 0".
_RANGE_TEXT = (
    "in [2**-126, 2**126] (about 1.2e-38 to 8.5e37: it and its reciprocal normal fp32 numbers)"
)
_autocast_enabled = torch.is_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_INT_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32}
)


def _not_int64_exact(arg: str, dtype: torch.dtype) -> NoReturn:
    """An id tensor of a dtype without an exact int64 form (compared with ``ignore_index`` and
    the vocabulary in int64): floats, bool, complex, and uint64 (past 2**63 it wraps negative,
    e.g. onto -100)."""
    raise TypeError(
        f"{arg} must be an integer tensor that converts to int64 exactly (int8 to int64, uint8 to "
        f"uint32), got dtype {dtype}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32``/``fp16``/``bf16`` for a supported dtype."""
    return _FLOAT_DTYPES[dtype]


def is_dtensor(t: object) -> bool:
    """A DTensor (or subclass), known by name: no import of torch.distributed. The MRO is sliced
    because torch.compile iterates a tuple it made, not a type's own ``__mro__``."""
    return any(c.__name__ == "DTensor" for c in type(t).__mro__[:])


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def _not_dense(arg: str, t: torch.Tensor) -> NoReturn:
    """A sparse, nested or other non-strided tensor, named (the backends index strided memory)."""
    what = "a nested tensor" if t.is_nested else f"layout {t.layout}"
    fix = f"; pass {arg}.to_dense()" if t.layout is not _STRIDED and not t.is_nested else ""
    raise TypeError(f"{arg} must be a dense (torch.strided) tensor, got {what}{fix}")


def _tensor(arg: str, value: object) -> torch.Tensor:
    if value.__class__ in _PLAIN:  # the common case, without walking the MRO
        t: torch.Tensor = value  # type: ignore[assignment]
        if t.layout is not _STRIDED or t.is_nested:
            _not_dense(arg, t)
        return t
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout is not _STRIDED or value.is_nested:
        _not_dense(arg, value)
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


def _positive_float(arg: str, value: object) -> float:
    """``value`` as a float in ``SCALAR_RANGE``: any real number but a bool (Python's, or a
    NumPy scalar such as a config's ``np.float32``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg} must be a float, got {type(value).__name__} {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        out = math.inf
    if not _LO <= out <= _HI:  # NaN fails both comparisons
        shown = (
            value
            if not isinstance(value, int) or abs(value) < 10**20
            else f"an int of {len(str(abs(value)))} digits"
        )
        raise ValueError(f"{arg} must be a finite float > 0 {_RANGE_TEXT}, got {shown}")
    return out


def _integer(arg: str, value: object, expected: str) -> int:
    """``value`` as an int: any integer but a bool (Python's, or a NumPy integer such as a
    config's ``np.int64``, as ``operator.index`` takes it)."""
    if value.__class__ is int:
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg} must be {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def _no_inference_tensor(*named: tuple[str, torch.Tensor]) -> None:
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


def _flag(arg: str, value: object) -> bool:
    if value is True or value is False:
        return value
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _not_a_flag(arg: str, value: object) -> NoReturn:
    raise TypeError(f"{arg} must be a bool, got {type(value).__name__} {value!r}")


#: HeadCall's fields as ``validate`` builds them, positionally: a change to the protocol must be
#: made here too (checked on import, so it cannot build a misordered call).
_HEAD_CALL_FIELDS = (
    "hidden",
    "weight",
    "labels",
    "temperature",
    "softcap",
    "ignore_index",
    "vocab_start",
    "vocab_size",
    "process_group",
    "reduce_hidden_grad",
    "outputs",
    "top_k",
    "gather_ids",
)
if HeadCall._fields != _HEAD_CALL_FIELDS:  # pragma: no cover - a protocol edit without this one
    raise ImportError(
        f"fusedhead.validation builds HeadCall with the fields {_HEAD_CALL_FIELDS}, but "
        f"protocol.HeadCall has {HeadCall._fields}"
    )
_new_tuple = tuple.__new__

#: Per device: its type and whether ``torch.is_autocast_enabled`` knows that type (not meta).
#: ``device.type`` builds a new str on every read (slow, per call); devices are few.
_DEVICES: dict[torch.device, tuple[str, bool]] = {}


def _device_entry(dev: torch.device) -> tuple[str, bool]:
    """The first call on ``dev``: its type, and whether autocast has a state for it."""
    dev_type = dev.type
    try:
        torch.is_autocast_enabled(dev_type)
        known = True
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        known = False
    entry = _DEVICES[dev] = (dev_type, known)
    return entry


#: Device types every process can use: tensors there need no accelerator.
_ALWAYS_USABLE = frozenset({"cpu", "meta"})


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


def validate(
    hidden: object,
    weight: object,
    labels: object,
    temperature: object,
    ignore_index: object,
    return_entropy: object,
    process_group: Any,
    vocab_start: object,
    vocab_size: object,
    reduce_hidden_grad: object,
    check_labels: object,
    softcap: object,
    pending: Pending | None = None,
) -> tuple[HeadCall, tuple[int, ...], int, torch.device, torch.dtype, str | None]:
    """Check a call against the contract, reading each tensor property once (it runs every step).

    Returns the backend's 2-D call, the labels' shape (a torch.Size), N, the device and dtype the
    backend runs on, and the device type whose autocast is on (None: off), so the caller reads
    none of them again. The value checks (label range, per-token temperatures) go to ``pending``
    when given, else are read at once.
    """
    h = hidden if hidden.__class__ in _PLAIN else _tensor("hidden", hidden)
    w = weight if weight.__class__ in _PLAIN else _tensor("weight", weight)
    y = labels if labels.__class__ in _PLAIN else _tensor("labels", labels)
    if h.layout is not _STRIDED or w.layout is not _STRIDED or y.layout is not _STRIDED:
        for arg, t in (("hidden", h), ("weight", w), ("labels", y)):
            _tensor(arg, t)
    if h.is_nested or w.is_nested or y.is_nested:  # a nested tensor has no sizes to read
        for arg, t in (("hidden", h), ("weight", w), ("labels", y)):
            _tensor(arg, t)
    if return_entropy is True:
        outputs = _WITH_ENTROPY
    elif return_entropy is False:
        outputs = _LOG_PROBS_ONLY
    else:
        _not_a_flag("return_entropy", return_entropy)
    if reduce_hidden_grad is not True and reduce_hidden_grad is not False:
        _not_a_flag("reduce_hidden_grad", reduce_hidden_grad)
    if check_labels is not True and check_labels is not False:
        _not_a_flag("check_labels", check_labels)
    if ignore_index.__class__ is not int:
        ignore_index = _integer("ignore_index", ignore_index, "an int")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")

    hs, ws, ys = h.shape, w.shape, y.shape
    nd = len(hs)
    if not nd:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if len(ws) != 2:
        raise ValueError(f"weight must have shape [V, H], got shape {tuple(ws)}")
    V, H = ws
    if H == 0 or V == 0:
        raise ValueError(
            f"weight must be non-empty [V, H] with V > 0 and H > 0, got shape {tuple(ws)}"
        )
    if hs[-1] != H:
        raise ValueError(
            f"hidden's last dimension must equal weight's H={H}, got hidden shape {tuple(hs)}"
        )
    if nd == 2:  # the common case: [N, H] and [N], compared as tuples without slicing a Size
        n = hs[0]
        if len(ys) != 1 or ys[0] != n:
            raise ValueError(f"labels must have hidden's leading shape ({n},), got {tuple(ys)}")
    else:
        if ys != hs[:-1]:
            raise ValueError(
                f"labels must have hidden's leading shape {tuple(hs[:-1])}, got {tuple(ys)}"
            )
        n = math.prod(ys)
    ydt = y.dtype
    if ydt is not _I64 and ydt not in _INT_DTYPES:
        _not_int64_exact("labels", ydt)
    hdt, wdt = h.dtype, w.dtype
    if hdt not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, float16 or bfloat16, got dtype {hdt}")
    if wdt is not hdt and wdt not in _FLOAT_DTYPES:
        raise TypeError(f"weight must be float32, float16 or bfloat16, got dtype {wdt}")
    dev = h.device
    wdev = w.device
    if wdev != dev:
        raise ValueError(
            f"hidden and weight must be on one device, got hidden on {dev}, weight on {wdev}"
        )
    ydev = y.device
    if ydev != dev:
        raise ValueError(f"labels must be on hidden's device {dev}, got {ydev}")
    dev_type, known = _DEVICES.get(dev) or _device_entry(dev)
    cast = dev_type if known and _autocast_enabled(dev_type) else None
    if cast is not None:  # compute in the autocast dtype, like the matmul this replaces
        hdt = torch.get_autocast_dtype(cast)
        h, w = h.to(hdt), w.to(hdt)
    elif wdt is not hdt:
        raise TypeError(
            f"hidden and weight must share a dtype outside torch.autocast, got hidden {hdt} and "
            f"weight {wdt}; cast one of them or call inside torch.autocast"
        )
    if (h.requires_grad or w.requires_grad) and _grad_enabled():  # what the backend will save
        _no_inference_tensor(("hidden", h), ("weight", w))

    if process_group is None:
        if vocab_start is not None or vocab_size is not None:
            _whole_vocabulary(V, vocab_start, vocab_size)
        start, size = 0, V
    else:
        start, size = _shard(process_group, V, vocab_start, vocab_size)

    if temperature.__class__ is float and _LO <= temperature <= _HI:  # type: ignore[operator]
        temp: float | torch.Tensor = temperature  # type: ignore[assignment]
    else:
        temp = _temperature(temperature, y, dev, pending=pending, check=check_labels)
    cap = None if softcap is None else _positive_float("softcap", softcap)

    flat = y if nd == 2 else y.reshape(-1)
    if ydt is not _I64:
        flat = flat.to(torch.int64)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if check_labels and n and dev_type != "meta":
        flat = _check_label_range(flat, ignore_index, size, pending)
    # The tuple of the fields in _HEAD_CALL_FIELDS' order, without HeadCall's Python __new__.
    call: HeadCall = _new_tuple(
        HeadCall,
        (
            h if nd == 2 else h.reshape(-1, H),
            w,
            flat,
            temp,
            cap,
            ignore_index,
            start,
            size,
            process_group,
            reduce_hidden_grad,
            outputs,
            0,
            None,
        ),
    )
    return call, ys, n, dev, hdt, cast


_WITH_ENTROPY = frozenset({"log_probs", "entropy"})
_LOG_PROBS_ONLY = frozenset({"log_probs"})


def _apply_autocast(
    h: torch.Tensor, w: torch.Tensor, dev: str, names: tuple[str, str] = ("hidden", "weight")
) -> tuple[torch.Tensor, torch.Tensor]:
    """Under autocast, compute in the autocast dtype like the matmul this replaces; else insist on
    one dtype (``names``: the two arguments, for the error)."""
    try:
        autocast = torch.is_autocast_enabled(dev)
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        autocast = False
    if autocast:
        dt = torch.get_autocast_dtype(dev)
        return h.to(dt), w.to(dt)
    if h.dtype != w.dtype:
        a, b = names
        raise TypeError(
            f"{a} and {b} must share a dtype outside torch.autocast, got {a} {h.dtype} and "
            f"{b} {w.dtype}; cast one of them or call inside torch.autocast"
        )
    return h, w


def _temperature(
    value: object,
    labels: torch.Tensor,
    device: torch.device,
    arg: str = "temperature",
    pending: Pending | None = None,
    check: object = True,
) -> float | torch.Tensor:
    """A float in ``SCALAR_RANGE``, or a tensor as fp32 ``[N]`` (broadcast to ``labels``).

    A tensor's type, device, gradient and shape are always checked (metadata: no read); its
    values only with ``check`` (a call's ``check_labels``: one device-to-host read, or
    ``pending``'s, or under ``torch.compile`` an op of the graph). ``check=False`` is the opt-out
    CUDA graphs need; the values then reach the backend unchecked (a bad one gives its row wrong values).
    """
    if value.__class__ is float and _LO <= value <= _HI:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if not isinstance(value, torch.Tensor):
        return _positive_float(arg, value)
    t = _tensor(arg, value)
    if not t.is_floating_point():
        raise TypeError(f"{arg} tensor must be floating point, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{arg} tensor must be on {device}, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{arg} tensor requires grad, but fusedhead does not differentiate with respect to a "
            f"temperature (no gradient would reach it); pass {arg}.detach()"
        )
    try:
        t = torch.broadcast_to(t, labels.shape)
    except RuntimeError:
        raise ValueError(
            f"{arg} tensor of shape {tuple(t.shape)} must broadcast to the labels' shape {tuple(labels.shape)}"
        ) from None
    t = t.detach().reshape(-1).to(torch.float32).contiguous()
    if check and t.numel() and t.device.type != "meta":
        if torch.compiler.is_compiling():
            checked: torch.Tensor = _temperature_checked(t, arg)  # the check below, in the graph
            return checked
        _check_temperature_values(t, arg, pending)
    return t


def _check_temperature_values(t: torch.Tensor, arg: str, pending: Pending | None = None) -> None:
    """Every per-token temperature in ``SCALAR_RANGE`` (so finite and > 0; one device-to-host
    read, or ``pending``'s)."""
    bad = ~((t >= _LO) & (t <= _HI)).all()  # NaN fails both comparisons
    if pending is not None:
        pending.add(bad, _raise_bad_temperature, arg, t)
    elif bool(bad):
        _raise_bad_temperature(arg, t)


def _raise_bad_temperature(arg: str, t: torch.Tensor) -> NoReturn:
    bad = ~((t >= _LO) & (t <= _HI))
    idx = int(bad.nonzero()[0, 0])
    raise ValueError(
        f"{arg} tensor must hold finite values > 0 {_RANGE_TEXT}, got {float(t[idx])} (as fp32) "
        f"at flat position {idx} ({int(bad.sum())} value(s) out of range)"
    )


def _vocab_ints(vocab_start: object, vocab_size: object) -> tuple[int | None, int | None]:
    """``vocab_start`` and ``vocab_size``: each an int (not a bool; a NumPy integer as its int)
    or None."""
    return (
        None if vocab_start is None else _integer("vocab_start", vocab_start, "an int or None"),
        None if vocab_size is None else _integer("vocab_size", vocab_size, "an int or None"),
    )


def _whole_vocabulary(v: int, vocab_start: object, vocab_size: object) -> None:
    """Without a process group the weight is the whole vocabulary: ``vocab_start`` may only be 0
    and ``vocab_size`` only V (or None)."""
    vocab_start, vocab_size = _vocab_ints(vocab_start, vocab_size)
    if (vocab_start is not None and vocab_start != 0) or (
        vocab_size is not None and vocab_size != v
    ):
        raise ValueError(
            "vocab_start and vocab_size describe a shard and need process_group; without it the "
            f"weight is the whole vocabulary (vocab_start=0, vocab_size={v}), got "
            f"vocab_start={vocab_start!r}, vocab_size={vocab_size!r}"
        )


def _shard(group: Any, v_local: int, vocab_start: object, vocab_size: object) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
            f"one from dist.new_group), got {type(group).__name__}"
        )
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    vocab_start, vocab_size = _vocab_ints(vocab_start, vocab_size)
    start = rank * v_local if vocab_start is None else vocab_start
    size = world * v_local if vocab_size is None else vocab_size
    assert isinstance(start, int) and isinstance(size, int)
    if size > _INT64_MAX:
        raise ValueError(f"vocab_size must fit in int64 (global ids are int64), got {size}")
    if start < 0 or start + v_local > size:
        raise ValueError(
            f"vocab_start={start} with a local shard of {v_local} rows must lie within vocab_size={size}"
        )
    return start, size


def _check_label_range(
    labels: torch.Tensor, ignore_index: int, vocab_size: int, pending: Pending | None = None
) -> torch.Tensor:
    """One device-to-host read (or ``pending``'s); the first offending position is named. Returns
    ``labels`` (under torch.compile, the checked copy from the graph's op: see ``_labels_checked``)."""
    if torch.compiler.is_compiling():
        checked: torch.Tensor = _labels_checked(labels, ignore_index, vocab_size)
        return checked
    bad = _bad_labels(labels, ignore_index, vocab_size)
    if pending is not None:
        pending.add(bad.any(), _raise_bad_labels, labels, bad, ignore_index, vocab_size)
    elif bool(bad.any()):
        _raise_bad_labels(labels, bad, ignore_index, vocab_size)
    return labels


def _bad_labels(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))


def _raise_bad_labels(
    labels: torch.Tensor, bad: torch.Tensor, ignore_index: int, vocab_size: int
) -> NoReturn:
    idx = int(bad.nonzero()[0, 0])
    count = int(bad.sum())
    raise ValueError(
        f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}, got {int(labels[idx])} "
        f"at flat position {idx} ({count} label(s) out of range); pass check_labels=False to skip "
        "this check (such rows then give NaN)"
    )


def _top_k(value: object, vocab_size: int) -> int:
    if value is None:
        return 0
    value = _integer("top_k", value, "an int or None")
    if not 1 <= value <= vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab_size}] or None, got {value}")
    return value


def _gather_ids(
    value: object,
    shape: tuple[int, ...],
    call: HeadCall,
    do_check: bool,
    pending: Pending | None = None,
) -> torch.Tensor | None:
    """``gather_ids [..., K]`` as a contiguous int64 ``[N, K]``; ids in range where they count."""
    if value is None:
        return None
    ids = _tensor("gather_ids", value)
    if ids.dtype not in _INT_DTYPES:
        _not_int64_exact("gather_ids", ids.dtype)
    if ids.dim() != len(shape) + 1 or tuple(ids.shape[:-1]) != shape or ids.shape[-1] < 1:
        raise ValueError(
            f"gather_ids must have the labels' shape {shape} plus a last dimension K >= 1, got "
            f"shape {tuple(ids.shape)}"
        )
    if ids.device != call.hidden.device:
        raise ValueError(
            f"gather_ids must be on hidden's device {call.hidden.device}, got {ids.device}"
        )
    flat = ids.reshape(-1, ids.shape[-1]).to(torch.int64).contiguous()
    if do_check and flat.numel() and flat.device.type != "meta":
        if torch.compiler.is_compiling():  # the check below, as an op of the graph
            checked: torch.Tensor = _gather_ids_checked(
                flat, call.labels, call.ignore_index, call.vocab_size
            )
            return checked
        _check_gather_range(flat, call.labels, call.ignore_index, call.vocab_size, pending)
    return flat


def _check_gather_range(
    flat: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    pending: Pending | None = None,
) -> None:
    """The ids that count (scored rows, not ignore_index) in range: one device-to-host read, or
    ``pending``'s."""
    counted = (labels != ignore_index).unsqueeze(1) & (flat != ignore_index)
    bad = counted & ((flat < 0) | (flat >= vocab_size))
    if pending is not None:
        pending.add(bad.any(), _raise_bad_ids, flat, bad, ignore_index, vocab_size)
    elif bool(bad.any()):
        _raise_bad_ids(flat, bad, ignore_index, vocab_size)


def _raise_bad_ids(
    flat: torch.Tensor, bad: torch.Tensor, ignore_index: int, vocab_size: int
) -> NoReturn:
    row, col = (int(i) for i in bad.nonzero()[0])
    raise ValueError(
        f"gather_ids must be in [0, {vocab_size}) or ignore_index={ignore_index} "
        f"on scored rows, got {int(flat[row, col])} at flat row {row}, position {col} "
        f"({int(bad.sum())} id(s) out of range); pass check_labels=False to skip this "
        "check (such ids then give NaN)"
    )


class Pending:
    """A call's value checks (label and id ranges, per-token temperatures), read by the host in
    one go.

    Each check adds its flag, computed where the tensors are. On CUDA, ``send`` (just before the
    backend's ``forward``) copies the flags to pinned host memory behind an event, and ``settle``
    (after ``forward`` has queued the head's kernels) waits for that event only, then raises the
    first failed check's error, so the GPU never idles while the host waits for a check. That is
    safe because a backend must be memory-safe on out-of-range values anyway (``check_labels=False``
    gives NaN rows). Elsewhere ``send`` reads the flags at once, before the backend sees the call.
    """

    __slots__ = ("_checks", "_event", "_host")

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[..., NoReturn], tuple[Any, ...]]] = []
        self._host: torch.Tensor | None = None
        self._event: Any = None

    def add(self, bad: torch.Tensor, raiser: Callable[..., NoReturn], *args: Any) -> None:
        """A 0-d bool ``bad``; ``raiser(*args)`` raises the check's error when it is set."""
        self._checks.append((bad, raiser, args))

    def send(self) -> None:
        """Start the flags' one read (CUDA: queued behind an event), or raise now (elsewhere)."""
        checks = self._checks
        if not checks:
            return
        flags = checks[0][0] if len(checks) == 1 else torch.stack([c[0] for c in checks])
        if flags.device.type != "cuda":
            self._host = flags
            self.settle()
            return
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "check_labels=True checks the label range (and any gather_ids and per-token "
                "temperature tensor) by a device-to-host read, which CUDA-graph capture forbids; "
                "inside a captured region pass check_labels=False (it skips all three value checks)"
            )
        self._host = flags.to("cpu", non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(flags.device))

    def settle(self) -> None:
        """Wait for the flags (not for the head's kernels) and raise the first failed check's error."""
        host = self._host
        if host is None:
            return
        self._host = None
        if self._event is not None:
            self._event.synchronize()
        failed = host.tolist()
        for bad, (_, raiser, args) in zip(
            failed if isinstance(failed, list) else [failed], self._checks, strict=True
        ):
            if bad:
                raiser(*args)


# While torch.compile traces, a check cannot read a tensor's values: that is a data-dependent
# branch, which breaks the graph. Each check above is then one opaque custom op whose kernel is
# the eager check, so a compiled step raises the very same ValueError (and pays the same host
# sync). The op hands its input back as a copy that the call goes on with: an op whose output
# nothing reads would be dropped from the graph as dead code. (``torch._assert_async`` is no
# substitute: inductor's CPU kernels throw its error inside OpenMP regions, which aborts.)


@torch.library.custom_op("fusedhead::check_labels", mutates_args=())
def _labels_checked(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """``_check_label_range`` in a compiled graph; a copy of ``labels``."""
    _check_label_range(labels, ignore_index, vocab_size)
    return labels.clone()


@torch.library.custom_op("fusedhead::check_temperature", mutates_args=())
def _temperature_checked(t: torch.Tensor, arg: str) -> torch.Tensor:
    """``_check_temperature_values`` in a compiled graph; a copy of ``t``."""
    _check_temperature_values(t, arg)
    return t.clone()


@torch.library.custom_op("fusedhead::check_gather_ids", mutates_args=())
def _gather_ids_checked(
    flat: torch.Tensor, labels: torch.Tensor, ignore_index: int, vocab_size: int
) -> torch.Tensor:
    """``_check_gather_range`` in a compiled graph; a copy of ``flat``."""
    _check_gather_range(flat, labels, ignore_index, vocab_size)
    return flat.clone()


@_labels_checked.register_fake
@_temperature_checked.register_fake
@_gather_ids_checked.register_fake
def _checked_copy(t: torch.Tensor, *_: object) -> torch.Tensor:
    """What the three ops give while tracing: a tensor like their first input."""
    return torch.empty_like(t)


def with_outputs(
    call: HeadCall,
    shape: tuple[int, ...],
    *,
    top_k: object = None,
    gather_ids: object = None,
    return_lse: object = False,
    return_sum_p2: object = False,
    return_argmax: object = False,
    check_labels: object = True,
    pending: Pending | None = None,
) -> HeadCall:
    """``call`` with the further outputs asked for (top-k, gather, lse, sum_p2, argmax) validated;
    the ids' range check goes to ``pending`` when given (``validate``'s)."""

    outputs = set(call.outputs)
    for arg, flag, name in (
        ("return_lse", return_lse, "lse"),
        ("return_sum_p2", return_sum_p2, "sum_p2"),
        ("return_argmax", return_argmax, "argmax"),
    ):
        if _flag(arg, flag):
            outputs.add(name)
    k = _top_k(top_k, call.vocab_size)
    if k:
        outputs.add("topk")
    do_check = _flag("check_labels", check_labels)
    ids = _gather_ids(gather_ids, shape, call, do_check, pending)
    if ids is not None:
        outputs.add("gather")
    if outputs == call.outputs:
        return call
    changes: dict[str, Any] = {"outputs": frozenset(outputs), "top_k": k, "gather_ids": ids}
    if hasattr(call, "_replace"):  # HeadCall is a NamedTuple
        return call._replace(**changes)  # type: ignore[no-any-return]
    return dataclasses.replace(call, **changes)  # type: ignore[type-var]


def validate_kl(
    hidden: object,
    weight: object,
    teacher_hidden: object,
    teacher_weight: object,
    labels: object,
    *,
    temperature: object,
    teacher_temperature: object,
    ignore_index: object,
    direction: object,
    softcap: object = None,
    teacher_softcap: object = None,
    check: object = True,
) -> tuple[KLCall, tuple[int, ...]]:
    """Check a two-head KL call: the backend's 2-D call and the rows' shape (``check``: read
    and check per-token temperatures' values, as ``_temperature`` does)."""

    h = _tensor("hidden", hidden)
    w = _tensor("weight", weight)
    th = _tensor("teacher_hidden", teacher_hidden)
    tw = _tensor("teacher_weight", teacher_weight)
    check = _flag("check_labels", check)  # a truthy str or 0 must not pick a check silently
    if not isinstance(direction, str) or direction not in KL_DIRECTIONS:
        raise ValueError(
            f"direction must be one of {list(KL_DIRECTIONS)} (forward: KL(p_teacher || p_student), "
            f"reverse: KL(p_student || p_teacher)), got {direction!r}"
        )
    if ignore_index.__class__ is not int:
        ignore_index = _integer("ignore_index", ignore_index, "an int")
    if not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    for arg, t in (("hidden", h), ("teacher_hidden", th)):
        if t.dim() < 1:
            raise ValueError(f"{arg} must have shape [..., H], got a 0-d tensor")
    for arg, t in (("weight", w), ("teacher_weight", tw)):
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{arg} must be non-empty [V, H], got shape {tuple(t.shape)}")
    if h.shape[-1] != w.shape[1]:
        raise ValueError(
            f"hidden's last dimension must equal weight's H={w.shape[1]}, got hidden shape "
            f"{tuple(h.shape)}"
        )
    if th.shape[-1] != tw.shape[1]:
        raise ValueError(
            f"teacher_hidden's last dimension must equal teacher_weight's H={tw.shape[1]}, got "
            f"teacher_hidden shape {tuple(th.shape)}"
        )
    if tw.shape[0] != w.shape[0]:
        raise ValueError(
            f"teacher_weight must have the student's vocabulary V={w.shape[0]} rows, got shape "
            f"{tuple(tw.shape)}"
        )
    shape = tuple(h.shape[:-1])
    if tuple(th.shape[:-1]) != shape:
        raise ValueError(
            f"teacher_hidden must have hidden's leading shape {shape}, got {tuple(th.shape[:-1])}"
        )
    for arg, t in (("hidden", h), ("weight", w), ("teacher_hidden", th), ("teacher_weight", tw)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{arg} must be float32, float16 or bfloat16, got dtype {t.dtype}")
        if t.device != h.device:
            raise ValueError(f"{arg} must be on hidden's device {h.device}, got {t.device}")
    h, w = _apply_autocast(h, w, h.device.type)
    th, tw = _apply_autocast(th, tw, th.device.type, ("teacher_hidden", "teacher_weight"))
    if (h.requires_grad or w.requires_grad) and torch.is_grad_enabled():  # what is saved
        _no_inference_tensor(
            ("hidden", h), ("weight", w), ("teacher_hidden", th), ("teacher_weight", tw)
        )
    if th.dtype != h.dtype:
        raise TypeError(
            f"teacher_hidden and teacher_weight must share the student's dtype {h.dtype}, got "
            f"{th.dtype}; cast the teacher head"
        )
    if labels is None:
        rows = torch.zeros(shape, dtype=torch.int64, device=h.device)
        valid = torch.ones(math.prod(shape), dtype=torch.bool, device=h.device)
    else:
        rows = _tensor("labels", labels)
        if tuple(rows.shape) != shape:
            raise ValueError(
                f"labels must have hidden's leading shape {shape}, got {tuple(rows.shape)}"
            )
        if rows.dtype not in _INT_DTYPES:
            _not_int64_exact("labels", rows.dtype)
        if rows.device != h.device:
            raise ValueError(f"labels must be on hidden's device {h.device}, got {rows.device}")
        flat = rows.reshape(-1)
        if flat.dtype != torch.int64:  # compared in int64, as fused_head's labels: in a narrower
            flat = flat.to(torch.int64)  # dtype torch wraps ignore_index (uint8: -100 == 156)
        valid = (flat != ignore_index).contiguous()
    call = KLCall(
        hidden=h.reshape(-1, h.shape[-1]),
        weight=w,
        teacher_hidden=th.reshape(-1, th.shape[-1]),
        teacher_weight=tw,
        valid=valid,
        temperature=_temperature(temperature, rows, h.device, check=check),
        teacher_temperature=_temperature(
            teacher_temperature, rows, h.device, "teacher_temperature", check=check
        ),
        direction=direction,
        softcap=None if softcap is None else _positive_float("softcap", softcap),
        teacher_softcap=(
            None if teacher_softcap is None else _positive_float("teacher_softcap", teacher_softcap)
        ),
    )
    return call, shape


# --- vocab-parallel: the shards' union against vocab_size, carried in a backend's collective -----

#: Each shard bound (vocab_start, width, vocab_size: int64) travels as ``_SHARD_CHUNKS`` chunks of
#: ``_SHARD_BITS`` bits, each exact in fp32 and summed only with zeros, so the bits come back whole.
_SHARD_BITS = 21
_SHARD_CHUNKS = 3
#: Floats a rank's shard takes in a collective (see ``shard_slots``).
SHARD_FLOATS = 3 * _SHARD_CHUNKS
#: Shard layouts verified on CUDA, by (group id, vocab_start, width, vocab_size) (see
#: ``check_shards``).
_VERIFIED_SHARDS: set[tuple[int, int, int, int]] = set()


def shard_slots(start: int, width: int, size: int) -> list[float]:
    """This rank's shard ``[start, start + width)`` of ``size`` as ``SHARD_FLOATS`` floats, for a
    backend to carry in a collective it makes anyway (gathered, or summed in a one-hot slot)."""
    mask = (1 << _SHARD_BITS) - 1
    return [
        float((value >> (_SHARD_BITS * i)) & mask)
        for value in (start, width, size)
        for i in range(_SHARD_CHUNKS)
    ]


def _shard_ints(row: list[float]) -> tuple[int, int, int]:
    out = []
    for j in range(3):
        chunks = row[j * _SHARD_CHUNKS : (j + 1) * _SHARD_CHUNKS]
        out.append(sum(int(c) << (_SHARD_BITS * i) for i, c in enumerate(chunks)))
    return out[0], out[1], out[2]


def gathered_shards(layout: torch.Tensor) -> list[tuple[int, int, int]]:
    """Each rank's ``(vocab_start, width, vocab_size)`` from a gathered ``layout`` (one host read)."""
    return [_shard_ints(r) for r in layout.reshape(-1, SHARD_FLOATS).tolist()]


def shards_need_check(group: Any, start: int, width: int, size: int, device: torch.device) -> bool:
    """Whether ``check_shards`` should read this call's gathered layout: always on the CPU (the
    values are in host memory already); on CUDA, where reading them waits for the collective, the
    first time this rank sees (group, vocab_start, width, vocab_size)."""
    return device.type != "cuda" or (id(group), start, width, size) not in _VERIFIED_SHARDS


def check_shards(
    layout: torch.Tensor, rank: int, group: Any, start: int, width: int, size: int
) -> None:
    """Every rank's shard (``layout [world, SHARD_FLOATS]``, each row ``shard_slots``' of that
    rank) against ``vocab_size``: all ranks give one vocab_size, and their shards, none
    overlapping another, cover ``[0, vocab_size)``. Each rank reads the same layout, so on a bad
    one every rank raises the same ``ValueError`` (naming its own shard too)."""
    shards = gathered_shards(layout)  # the one host read
    shown = ", ".join(f"rank {r}: [{a}, {a + w}) of {s}" for r, (a, w, s) in enumerate(shards))
    mine = f"this rank ({rank}) passed vocab_start={start}, {width} local rows, vocab_size={size}"
    sizes = {s for _, _, s in shards}
    if len(sizes) != 1:
        raise ValueError(
            f"vocab_size must be the same on every rank of process_group, got {sorted(sizes)} "
            f"({shown}); {mine}"
        )
    covered = 0
    gaps: list[str] = []
    for a, w, _ in sorted((a, w, s) for a, w, s in shards if w):
        if a < covered:
            raise ValueError(
                f"the vocabulary shards of process_group overlap at id {a} ({shown}): each id "
                f"must lie in exactly one rank's shard; {mine}"
            )
        if a > covered:
            gaps.append(f"[{covered}, {a})")
        covered = a + w
    if covered < size:
        gaps.append(f"[{covered}, {size})")
    if gaps:
        raise ValueError(
            f"vocab_size={size} is larger than the union of the shards of process_group, which "
            f"leaves the ids {', '.join(gaps)} in no shard ({shown}): pass the vocab_size the "
            f"shards cover, or shards that cover vocab_size; {mine}"
        )
    if layout.device.type == "cuda":
        _VERIFIED_SHARDS.add((id(group), start, width, size))


_SHARD_TENSORS: dict[tuple[Any, ...], torch.Tensor] = {}


def shard_slots_tensor(
    start: int, width: int, size: int, device: torch.device, world: int = 1, rank: int = 0
) -> torch.Tensor:
    """fp32 ``[world, SHARD_FLOATS]``: zeros but for row ``rank``, this rank's ``shard_slots``
    (``world=1``: the row alone, to gather). Made once per shard and device, never written to
    (a backend copies it into the buffer of its collective)."""
    key = (start, width, size, device, world, rank)
    t = _SHARD_TENSORS.get(key)
    if t is None:
        t = torch.zeros((world, SHARD_FLOATS), dtype=torch.float32)
        t[rank] = torch.tensor(shard_slots(start, width, size), dtype=torch.float32)
        t = _SHARD_TENSORS[key] = t.to(device)
    return t


def grid_shards(vocab_size: int, world: int, grid: int) -> list[tuple[int, int]]:
    """``(vocab_start, rows)`` of each of ``world`` ranks: whole tiles of ``grid`` columns, as
    even as they go (the first ranks one tile more), the last shard ending at ``vocab_size``.

    Every shard starts on a multiple of ``grid``: a backend declaring ``degree_invariant`` with
    that ``vocab_grid`` gives the one-process bits on this layout (docs/vocab-parallel.md). Equal
    shards are this layout exactly when ``vocab_size / world`` is a multiple of ``grid``. Ranks
    past the last tile get empty shards (which ``fused_head`` refuses: use fewer ranks than tiles).
    """
    for name, value, least in (
        ("vocab_size", vocab_size, 0),
        ("world", world, 1),
        ("grid", grid, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    tiles = -(-vocab_size // grid)
    base, extra = divmod(tiles, world)
    out: list[tuple[int, int]] = []
    start = 0
    for rank in range(world):
        stop = min(vocab_size, start + (base + (rank < extra)) * grid)
        out.append((start, stop - start))
        start = stop
    return out
