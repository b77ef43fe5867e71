"""Validation of a call before any backend sees it: one place, the same for every backend.

``check_head`` (head calls), ``with_outputs`` (the further outputs) and ``check_kl`` build the
backend's call from the arguments; the checkers they share are in ``fusedhead.checks``, the checks
of tensor values in ``fusedhead.value_checks``.

Every refusal is a ``ValueError``/``TypeError`` that names the argument, what it got and what
was expected.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from fusedhead.checks import (
    DEVICES,
    FLOAT_DTYPES,
    INT64_MAX,
    INT64_MIN,
    INT_DTYPES,
    PLAIN,
    SCALAR_HI,
    SCALAR_LO,
    STRIDED,
    device_entry,
    flag_arg,
    integer,
    no_inference_tensor,
    not_a_flag,
    not_int64_exact,
    per_token_rank,
    positive_float,
    saveable,
    tensor_arg,
    width_mismatch,
)
from fusedhead.errors import type_name
from fusedhead.protocol import KL_DIRECTIONS, HeadCall, KLCall
from fusedhead.request import FIRST_FLAG, OUTPUT_FLAGS, HeadRequest, KLRequest
from fusedhead.value_checks import (
    KL_UNCHECKED_EFFECT,
    Pending,
    check_gather_range,
    check_label_range,
    check_temperature_values,
    gather_ids_checked,
    temperature_checked,
)

# Module constants for the per-call path (a global read, not a global and an attribute).
_I64 = torch.int64
_autocast_enabled = torch.is_autocast_enabled
#: False while no device type has autocast on (the common case): one call, half the time of
#: asking about one device type (Dynamo folds it as it folds is_autocast_enabled). A torch
#: without it asks about the device itself.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)
_grad_enabled = torch.is_grad_enabled

#: HeadCall's fields as ``check_head`` builds them, positionally: a change to the protocol must be
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
#: The request's fields before its output flags, as ``check_head`` unpacks them (the flags after
#: them, whatever their number): checked on import, as ``_HEAD_CALL_FIELDS``.
_REQUEST_FIELDS = (
    "hidden",
    "weight",
    "labels",
    "temperature",
    "ignore_index",
    "return_entropy",
    "process_group",
    "vocab_start",
    "vocab_size",
    "reduce_hidden_grad",
    "check_labels",
    "softcap",
    "top_k",
    "gather_ids",
)
if HeadRequest._fields[:FIRST_FLAG] != _REQUEST_FIELDS:  # pragma: no cover - a request edit
    raise ImportError(
        f"fusedhead.validation unpacks HeadRequest as {_REQUEST_FIELDS} and the output flags, "
        f"but request.HeadRequest has {HeadRequest._fields}"
    )
_new_tuple = tuple.__new__


class Checked(NamedTuple):
    """A head request checked: what ``check_head`` answers, so the caller reads none of it again."""

    #: The backend's 2-D call.
    call: HeadCall
    #: The labels' shape (a torch.Size for a plain call, a tuple with further outputs).
    shape: tuple[int, ...]
    #: N, the rows.
    n: int
    #: The device and dtype the backend runs on.
    device: torch.device
    dtype: torch.dtype
    #: The device type whose autocast is on (None: off).
    cast: str | None
    #: Whether the call records gradients (hidden or weight requires grad, grad mode on).
    grad: bool
    #: Log-probs and entropy only, a float temperature, no softcap, no process group: the
    #: capability gate's short path.
    plain: bool


def check_head(req: HeadRequest, pending: Pending | None = None) -> Checked:
    """Check a head request against the contract, the further outputs asked for included
    (``with_outputs``), reading each tensor property once. The value checks (label range, ids,
    per-token temperatures) go to ``pending`` when given, else are read at once."""
    # The request's fields, read once (one unpacking: the cheapest read); the output flags last.
    (
        hidden,
        weight,
        labels,
        temperature,
        ignore_index,
        return_entropy,
        process_group,
        vocab_start,
        vocab_size,
        reduce_hidden_grad,
        check_labels,
        softcap,
        top_k,
        gather_ids,
        *flags,
    ) = req
    h = hidden if hidden.__class__ in PLAIN else tensor_arg("hidden", hidden)
    w = weight if weight.__class__ in PLAIN else tensor_arg("weight", weight)
    y = labels if labels.__class__ in PLAIN else tensor_arg("labels", labels)
    if h.layout is not STRIDED or w.layout is not STRIDED or y.layout is not STRIDED:
        for arg, t in (("hidden", h), ("weight", w), ("labels", y)):
            tensor_arg(arg, t)
    try:
        hs, ws, ys = h.shape, w.shape, y.shape
    except RuntimeError:  # a nested tensor has no sizes to read: refused by name
        for arg, t in (("hidden", h), ("weight", w), ("labels", y)):
            tensor_arg(arg, t)
        raise
    if return_entropy is True:
        outputs = _WITH_ENTROPY
    elif return_entropy is False:
        outputs = _LOG_PROBS_ONLY
    else:
        not_a_flag("return_entropy", return_entropy)
    if reduce_hidden_grad is not True and reduce_hidden_grad is not False:
        not_a_flag("reduce_hidden_grad", reduce_hidden_grad)
    if check_labels is not True and check_labels is not False:
        not_a_flag("check_labels", check_labels)
    if ignore_index.__class__ is not int:
        ignore_index = integer("ignore_index", ignore_index, "an int")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")

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
        raise width_mismatch(tuple(hs), tuple(ws))
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
    if ydt is not _I64 and ydt not in INT_DTYPES:
        not_int64_exact("labels", ydt)
    hdt, wdt = h.dtype, w.dtype
    if hdt not in FLOAT_DTYPES:
        raise TypeError(
            f"hidden must be float32, float16 or bfloat16, got dtype {hdt}: cast it, e.g. "
            "hidden.float()"
        )
    if wdt is not hdt and wdt not in FLOAT_DTYPES:
        raise TypeError(
            f"weight must be float32, float16 or bfloat16, got dtype {wdt}: cast it, e.g. "
            "weight.float()"
        )
    dev = h.device
    wdev = w.device
    if wdev != dev:
        raise ValueError(
            f"hidden and weight must be on one device, got hidden on {dev}, weight on {wdev}"
        )
    ydev = y.device
    if ydev != dev:
        raise ValueError(f"labels must be on hidden's device {dev}, got {ydev}")
    dev_type, known = DEVICES.get(dev) or device_entry(dev)
    cast = dev_type if known and _any_autocast() and _autocast_enabled(dev_type) else None
    if cast is not None:  # compute in the autocast dtype, like the matmul this replaces
        hdt = torch.get_autocast_dtype(cast)
        h, w = h.to(hdt), w.to(hdt)
    elif wdt is not hdt:
        raise TypeError(
            f"hidden and weight must share a dtype outside torch.autocast, got hidden {hdt} and "
            f"weight {wdt}; cast one of them or call inside torch.autocast"
        )
    # A negative view (``x.conj().imag``) holds -x in its memory, which a backend's own kernel
    # reads: resolved here, x itself (a no-op, 0.2 us, for any other tensor; traceable).
    h, w = h.resolve_neg(), w.resolve_neg()
    grad = (h.requires_grad or w.requires_grad) and _grad_enabled()
    if grad:  # what the backend will save
        no_inference_tensor(("hidden", h), ("weight", w))

    if process_group is None:
        if vocab_start is not None or vocab_size is not None:
            _whole_vocabulary(V, vocab_start, vocab_size)
        start, size = 0, V
    else:
        start, size = _shard(process_group, V, vocab_start, vocab_size)

    flat = y if nd == 2 else y.reshape(-1)
    if ydt is not _I64:
        flat = flat.to(torch.int64)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if grad:
        flat = saveable(flat)
    if check_labels and n and dev_type != "meta":
        flat = check_label_range(flat, ignore_index, size, pending)

    if temperature.__class__ is float and SCALAR_LO <= temperature <= SCALAR_HI:  # type: ignore[operator]
        temp: float | torch.Tensor = temperature  # type: ignore[assignment]
    else:
        scored = None if not isinstance(temperature, torch.Tensor) else flat != ignore_index
        temp = _temperature(temperature, y, dev, pending=pending, check=check_labels, scored=scored)
    cap = None if softcap is None else positive_float("softcap", softcap)
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
    if top_k is None and gather_ids is None:
        for flag in flags:
            if flag is not False:  # asked for, or not a bool (with_outputs names it)
                break
        else:
            plain = temp.__class__ is float and cap is None and process_group is None
            return _new_tuple(Checked, (call, ys, n, dev, hdt, cast, grad, plain))
    shape = tuple(ys)  # messages show it as a tuple
    called = with_outputs(call, shape, req, pending)
    return _new_tuple(Checked, (called, shape, n, dev, hdt, cast, grad, False))


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
        h, w = h.to(dt), w.to(dt)
    elif h.dtype != w.dtype:
        a, b = names
        raise TypeError(
            f"{a} and {b} must share a dtype outside torch.autocast, got {a} {h.dtype} and "
            f"{b} {w.dtype}; cast one of them or call inside torch.autocast"
        )
    return h.resolve_neg(), w.resolve_neg()  # a negative view's memory holds -x (see check_head)


def _temperature(
    value: object,
    labels: torch.Tensor,
    device: torch.device,
    arg: str = "temperature",
    pending: Pending | None = None,
    check: object = True,
    scored: torch.Tensor | None = None,
) -> float | torch.Tensor:
    """A float in ``SCALAR_RANGE``, or a tensor as fp32 ``[N]`` (broadcast to ``labels``).

    A tensor's type, device, gradient and shape are always checked (metadata: no read); its
    values only with ``check`` (a call's ``check_labels``: one device-to-host read, or
    ``pending``'s, or under ``torch.compile`` an op of the graph). ``check=False`` is the opt-out
    CUDA graphs need; the values then reach the backend unchecked (a bad one gives its row wrong values).
    With ``scored`` (``[N]`` bool), an ignored row may hold any value, as every other per-token
    input may: the backend gets 1.0 there (or its ``min_temperature``, ``contract``'s gate), so
    padding's 0 or NaN reaches no kernel."""
    if value.__class__ is float and SCALAR_LO <= value <= SCALAR_HI:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{arg} must be a float or a tensor (per token), got {type_name(value)} {value!r}"
            )
        return positive_float(arg, value)
    t = tensor_arg(arg, value)
    if not t.is_floating_point():
        raise TypeError(f"{arg} tensor must be floating point, got dtype {t.dtype}")
    if t.device != device:
        raise ValueError(f"{arg} tensor must be on {device}, got {t.device}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{arg} tensor requires grad, but fusedhead does not differentiate with respect to a "
            f"temperature (no gradient would reach it); pass {arg}.detach()"
        )
    per_token_rank(arg, t, tuple(labels.shape), f"{arg} tensor")
    try:
        t = torch.broadcast_to(t, labels.shape)
    except RuntimeError:
        raise ValueError(
            f"{arg} tensor of shape {tuple(t.shape)} must broadcast to the labels' shape {tuple(labels.shape)}"
        ) from None
    t = t.detach().reshape(-1).to(torch.float32).resolve_neg().contiguous()
    t = saveable(t if scored is None else torch.where(scored, t, 1.0))
    if check and t.numel() and t.device.type != "meta":
        if torch.compiler.is_compiling():
            checked: torch.Tensor = temperature_checked(t, arg)  # the check below, in the graph
            return checked
        check_temperature_values(t, arg, pending)
    return t


def _vocab_ints(vocab_start: object, vocab_size: object) -> tuple[int | None, int | None]:
    """``vocab_start`` and ``vocab_size``: each an int (not a bool; a NumPy integer as its int)
    or None."""
    return (
        None if vocab_start is None else integer("vocab_start", vocab_start, "an int or None"),
        None if vocab_size is None else integer("vocab_size", vocab_size, "an int or None"),
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
        outside = group is dist.GroupMember.NON_GROUP_MEMBER
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or "
            f"one from dist.new_group), got {type(group).__name__} {group!r}"
            + (
                ": dist.new_group gives GroupMember.NON_GROUP_MEMBER on a rank outside the "
                "group; call with that group only on its members"
                if outside
                else ""
            )
        )
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    vocab_start, vocab_size = _vocab_ints(vocab_start, vocab_size)
    start = rank * v_local if vocab_start is None else vocab_start
    size = world * v_local if vocab_size is None else vocab_size
    assert isinstance(start, int) and isinstance(size, int)
    if size > INT64_MAX:
        raise ValueError(f"vocab_size must fit in int64 (global ids are int64), got {size}")
    if start < 0 or start + v_local > size:
        raise ValueError(
            f"vocab_start={start} with a local shard of {v_local} rows must lie within vocab_size={size}"
        )
    return start, size


def _top_k(value: object, vocab_size: int) -> int:
    if value is None:
        return 0
    value = integer("top_k", value, "an int or None")
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
    ids = tensor_arg("gather_ids", value)
    if ids.dtype not in INT_DTYPES:
        not_int64_exact("gather_ids", ids.dtype)
    if ids.dim() != len(shape) + 1 or tuple(ids.shape[:-1]) != shape or ids.shape[-1] < 1:
        raise ValueError(
            f"gather_ids must have the labels' shape {shape} plus a last dimension K >= 1, got "
            f"shape {tuple(ids.shape)}"
        )
    if ids.device != call.hidden.device:
        raise ValueError(
            f"gather_ids must be on hidden's device {call.hidden.device}, got {ids.device}"
        )
    flat = saveable(ids.reshape(-1, ids.shape[-1]).to(torch.int64).contiguous())
    if do_check and flat.numel() and flat.device.type != "meta":
        if torch.compiler.is_compiling():  # the check below, as an op of the graph
            checked: torch.Tensor = gather_ids_checked(
                flat, call.labels, call.ignore_index, call.vocab_size
            )
            return checked
        check_gather_range(flat, call.labels, call.ignore_index, call.vocab_size, pending)
    return flat


def with_outputs(
    call: HeadCall, shape: tuple[int, ...], req: HeadRequest, pending: Pending | None = None
) -> HeadCall:
    """``call`` with the further outputs ``req`` asks for (top-k, gather, lse, sum_p2, argmax)
    validated; the ids' range check goes to ``pending`` when given (``check_head``'s)."""

    outputs = set(call.outputs)
    for arg, name in OUTPUT_FLAGS:
        if flag_arg(arg, getattr(req, arg)):
            outputs.add(name)
    k = _top_k(req.top_k, call.vocab_size)
    if k:
        outputs.add("topk")
    do_check = flag_arg("check_labels", req.check_labels)
    ids = _gather_ids(req.gather_ids, shape, call, do_check, pending)
    if ids is not None:
        outputs.add("gather")
    if outputs == call.outputs:
        return call
    changes: dict[str, Any] = {"outputs": frozenset(outputs), "top_k": k, "gather_ids": ids}
    return call._replace(**changes)


def check_kl(req: KLRequest, pending: Pending | None = None) -> tuple[KLCall, tuple[int, ...]]:
    """Check a two-head KL request: the backend's 2-D call and the rows' shape (``check_labels``:
    read and check the labels' range and per-token temperatures' values, in ``pending``'s one read
    when given, as ``check_head`` does)."""
    hidden, weight, labels, direction = req.hidden, req.weight, req.labels, req.direction
    teacher_hidden, teacher_weight = req.teacher_hidden, req.teacher_weight
    temperature, teacher_temperature = req.temperature, req.teacher_temperature
    softcap, teacher_softcap = req.softcap, req.teacher_softcap
    ignore_index, check = req.ignore_index, req.check_labels
    h = tensor_arg("hidden", hidden)
    w = tensor_arg("weight", weight)
    th = tensor_arg("teacher_hidden", teacher_hidden)
    tw = tensor_arg("teacher_weight", teacher_weight)
    check = flag_arg("check_labels", check)  # a truthy str or 0 must not pick a check silently
    if not isinstance(direction, str) or direction not in KL_DIRECTIONS:
        raise ValueError(
            f"direction must be one of {list(KL_DIRECTIONS)} (forward: KL(p_teacher || p_student), "
            f"reverse: KL(p_student || p_teacher)), got {direction!r}"
        )
    if ignore_index.__class__ is not int:
        ignore_index = integer("ignore_index", ignore_index, "an int")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    for arg, t in (("hidden", h), ("teacher_hidden", th)):
        if t.dim() < 1:
            raise ValueError(f"{arg} must have shape [..., H], got a 0-d tensor")
    for arg, t in (("weight", w), ("teacher_weight", tw)):
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{arg} must be non-empty [V, H], got shape {tuple(t.shape)}")
    if h.shape[-1] != w.shape[1]:
        raise width_mismatch(tuple(h.shape), tuple(w.shape))
    if th.shape[-1] != tw.shape[1]:
        raise width_mismatch(
            tuple(th.shape), tuple(tw.shape), hidden="teacher_hidden", weight="teacher_weight"
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
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{arg} must be float32, float16 or bfloat16, got dtype {t.dtype}: cast it, e.g. "
                f"{arg}.float()"
            )
        if t.device != h.device:
            raise ValueError(f"{arg} must be on hidden's device {h.device}, got {t.device}")
    h, w = _apply_autocast(h, w, h.device.type)
    th, tw = _apply_autocast(th, tw, th.device.type, ("teacher_hidden", "teacher_weight"))
    if (h.requires_grad or w.requires_grad) and torch.is_grad_enabled():  # what is saved
        no_inference_tensor(
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
        rows = tensor_arg("labels", labels)
        if tuple(rows.shape) != shape:
            raise ValueError(
                f"labels must have hidden's leading shape {shape}, got {tuple(rows.shape)}"
            )
        if rows.dtype not in INT_DTYPES:
            not_int64_exact("labels", rows.dtype)
        if rows.device != h.device:
            raise ValueError(f"labels must be on hidden's device {h.device}, got {rows.device}")
        flat = rows.reshape(-1)
        if flat.dtype != torch.int64:  # compared in int64, as fused_head's labels: in a narrower
            flat = flat.to(torch.int64)  # dtype torch wraps ignore_index (uint8: -100 == 156)
        if check and flat.numel() and h.device.type != "meta":
            # Only a mask here, but a label out of range (padding of -1 beside ignore_index=-100)
            # is a mistake that would silently score its row: refused as fused_head refuses it.
            flat = check_label_range(flat, ignore_index, w.shape[0], pending, KL_UNCHECKED_EFFECT)
        valid = (flat != ignore_index).contiguous()
    call = KLCall(
        hidden=h.reshape(-1, h.shape[-1]),
        weight=w,
        teacher_hidden=th.reshape(-1, th.shape[-1]),
        teacher_weight=tw,
        valid=valid,
        temperature=_temperature(temperature, rows, h.device, "temperature", pending, check, valid),
        teacher_temperature=_temperature(
            teacher_temperature, rows, h.device, "teacher_temperature", pending, check, valid
        ),
        direction=direction,
        softcap=None if softcap is None else positive_float("softcap", softcap),
        teacher_softcap=(
            None if teacher_softcap is None else positive_float("teacher_softcap", teacher_softcap)
        ),
    )
    return call, shape
