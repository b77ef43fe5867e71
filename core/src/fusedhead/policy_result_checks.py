"""A backend's ``PolicyLossResult`` checked against the plugin contract: dtypes, shapes, devices,
and gradients of fresh memory. Apart from the call path (``policy.run``), as ``contract`` is from
the head's: what a backend must return, in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from fusedhead.protocol import PolicyLossCall, PolicyLossResult


def check_result(
    broke: Callable[[str], NoReturn],
    call: PolicyLossCall,
    result: object,
    n: int,
    device: torch.device,
) -> None:
    """The backend's result against the contract; a breach is a ``BackendContractError``
    (``broke``: the head's, which raises it naming the backend)."""
    if not isinstance(result, PolicyLossResult):
        broke(
            f"policy_loss() must return a fusedhead.protocol.PolicyLossResult, got "
            f"{type(result).__name__}"
        )
    for what, stat in (("log_probs", result.log_probs), ("entropy", result.entropy)):
        t: Any = stat
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (n,):
            broke(f"policy_loss's {what} must be float32 [{n}], got {_describe(t)}")
        if t.device != device:
            broke(f"policy_loss's {what} must be on {device}, got {t.device}")
    h, w = call.head.hidden, call.head.weight
    for what, need, t, like in (
        ("grad_hidden", call.need_hidden_grad, result.grad_hidden, h),
        ("grad_weight", call.need_weight_grad, result.grad_weight, w),
    ):
        if not need:
            if t is not None:
                broke(f"policy_loss's {what} was not asked for and must be None")
            continue
        widened = like.dtype == torch.float16 and getattr(t, "dtype", None) == torch.float32
        if (
            not isinstance(t, torch.Tensor)
            or t.shape != like.shape
            or (t.dtype != like.dtype and not widened)
            or t.device != like.device
        ):
            also = " (or float32)" if like.dtype == torch.float16 else ""
            broke(
                f"policy_loss's {what} must be {like.dtype}{also} {tuple(like.shape)} on "
                f"{like.device}, got {_describe(t)}"
            )
    _check_fresh(broke, call, result)


def _check_fresh(
    broke: Callable[[str], NoReturn], call: PolicyLossCall, result: PolicyLossResult
) -> None:
    """The gradients are fresh memory of their own: the backward scales them in place and
    autograd may keep them as ``.grad``, so one that overlaps itself (an ``expand``) or shares
    memory with an input or the other outputs would fail there or corrupt what it shares."""
    named = [("grad_hidden", result.grad_hidden), ("grad_weight", result.grad_weight)]
    others = [
        ("hidden", call.head.hidden),
        ("weight", call.head.weight),
        ("log_probs", result.log_probs),
        ("entropy", result.entropy),
        *named,
    ]
    for what, t in named:
        if t is None:
            continue
        if _overlaps_itself(t):
            broke(
                f"policy_loss's {what} must be a fresh tensor, got one whose elements share "
                f"memory (strides {tuple(t.stride())} for shape {tuple(t.shape)}, e.g. an "
                "expand): the backward scales it in place"
            )
        mine = t.untyped_storage().data_ptr()
        if mine == 0:  # no memory to share (empty, or the meta device)
            continue
        for other, u in others:
            if other != what and u is not None and u.untyped_storage().data_ptr() == mine:
                broke(
                    f"policy_loss's {what} must be a fresh tensor, got one that shares memory "
                    f"with {other}: the backward scales it in place and autograd may keep it"
                )


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements are one memory location (a stride of 0 where the size
    is more than 1, or strides that interleave)."""
    dims = sorted((st, size) for st, size in zip(t.stride(), t.shape, strict=True) if size > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * size
    return False


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {tuple(t.shape)} on {t.device}"
    return f"{type(t).__name__}"
