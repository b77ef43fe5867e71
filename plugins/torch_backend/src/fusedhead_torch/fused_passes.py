"""The elementwise passes ``torch.compile`` fuses (option ``compile_elementwise``, on for CUDA).

Only work whose bits no caller depends on is compiled: the logits' gradient (pointwise) for the
head's backward and the policy loss, and the policy loss's row statistics. The head's forward
statistics stay eager: an autotuned reduction could order a row's sum by the batch's shape and
break the forward's batch and degree invariance. Compiled without fused multiply-adds
(``emulate_precision_casts``), so ``d = k x - m`` rounds the product first, as the eager passes
do, and a row's largest logit gets ``d = 0`` exactly at any temperature.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

#: Inductor settings of every compiled pass: no fp contraction (see the module doc).
COMPILE_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "emulate_precision_casts": True
}


def row_stats(
    x: torch.Tensor, k: torch.Tensor, label: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's ``max z``, ``s = sum e``, ``t = sum e d`` and ``d`` at the label, with
    ``z = k x``, ``d = z - max z``, ``e = exp(d)`` (``k``: ``[rows, 1]``); one function, so that
    ``torch.compile`` fuses its passes over the fp32 logits into two reductions."""
    z = x * k
    m = z.amax(dim=1, keepdim=True)
    d = z - m
    e = torch.exp(d)
    return m.squeeze(1), e.sum(dim=1), (e * d).sum(dim=1), d.gather(1, label).squeeze(1)


def logits_grad(
    x: torch.Tensor, k: torch.Tensor, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """``e a + (e d) b`` in ``dtype`` with ``d = min(k x - m, 0)`` (``k``: ``[rows, 1]`` or
    ``[1, 1]``; ``m`` the forward's row max, which a recomputed ``x`` may pass by a rounding:
    ``tile_math.recomputed_offsets``; the label column not patched); compiled: one read of ``x``,
    one write."""
    d = torch.clamp(x.float() * k - m.unsqueeze(1), max=0.0)
    e = torch.exp(d)
    # e d before b: at tiny temperatures b d alone overflows where e is 0 (e d is at most 1/e).
    return (e * a.unsqueeze(1) + (e * d) * b.unsqueeze(1)).to(dtype)


def label_grad(
    e_y: torch.Tensor, d_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, onehot: torch.Tensor
) -> torch.Tensor:
    """The label column's ``e a + (e d) b + onehot`` in fp32 (``e d`` first, as in the tile)."""
    return e_y * a + (e_y * d_y) * b + onehot  # plain ops: each rounded (no fused multiply-add)


_PASSES: dict[str, Callable[..., Any]] = {"row_stats": row_stats, "logits_grad": logits_grad}
_COMPILED: dict[tuple[str, tuple[Any, ...]], Callable[..., Any]] = {}


def compiled(name: str, *variant: Any) -> Callable[..., Any]:
    """``row_stats`` or ``logits_grad`` through ``torch.compile`` (dynamic rows), made once per
    ``variant`` (what its graph is specialised on: device type, dtypes, a per-row ``k``).

    Each variant compiles a code object of its own: Dynamo keeps its graphs on the code object,
    and a process that mixes devices and dtypes would otherwise pass the recompile limit (8),
    which with ``fullgraph=True`` is an error, not a slower call.
    """
    key = (name, variant)
    fn = _COMPILED.get(key)
    if fn is None:
        base = _PASSES[name]
        code = base.__code__.replace(co_name=f"{name}_{len(_COMPILED)}")
        own = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__)
        fn = _COMPILED[key] = torch.compile(
            own, dynamic=True, fullgraph=True, options=COMPILE_OPTIONS
        )
    return fn


def compile_by_default(option: bool | None, device: torch.device) -> bool:
    """``compile_elementwise`` resolved: the option, else on for CUDA only (the first call
    compiles, seconds; the CPU gains little)."""
    return device.type == "cuda" if option is None else option
