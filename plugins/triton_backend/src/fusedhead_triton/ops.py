"""The one-shard autograd boundary of log-probs and entropy: a ``torch.library`` custom-op pair
(``custom_ops.register_pair``). A vocab-parallel call, the plain outputs included, is
``outputs.ShardedOutputs``.

No backward is differentiable: a double backward raises, never returning a silently first-order
gradient (these ops: when the second-order gradient is asked for; vocab-parallel: at
``create_graph=True`` already).
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as types.

from typing import Any

import torch

from .backward import backward
from .configs import Settings, TileConfig
from .custom_ops import grads_or_empty, register_pair
from .launch import HeadScalars, RowGrads, RowOutputs, combine, forward_partials


def forward_values(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, cfg: TileConfig, entropy: bool,
) -> RowOutputs:  # fmt: skip
    """(log_prob, normaliser [2, N], entropy-or-dummy) over one shard's whole vocabulary."""
    p = forward_partials(hidden, weight, labels, temp, sc, cfg)
    return combine(p, labels, sc.ignore_index, entropy=entropy)


def _grad(g: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else g.to(torch.float32).contiguous()


@torch.library.custom_op("fusedhead_triton::head_forward", mutates_args=())
def head_forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    label_offset: int, ignore_index: int, inv_temp: float, softcap: float | None, entropy: bool,
    settings: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(log_prob [N], normaliser [2, N]: row max and log s, entropy [N] or a dummy) of one
    shard, fp32."""
    sc = HeadScalars(label_offset, ignore_index, inv_temp, softcap)
    cfg = Settings.from_key(settings).forward
    return tuple(forward_values(hidden, weight, labels, temp, sc, cfg, entropy))  # type: ignore[return-value]


@torch.library.custom_op("fusedhead_triton::head_backward", mutates_args=())
def head_backward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    norm: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor | None, g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None, label_offset: int, ignore_index: int, inv_temp: float,
    softcap: float | None, settings: str, need_dh: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dh, dW) of one shard; an empty tensor for a gradient not asked."""
    sc = HeadScalars(label_offset, ignore_index, inv_temp, softcap)
    rows = RowGrads(labels, temp, norm, lp, ent, g_lp, g_ent)
    st = Settings.from_key(settings)
    dh, dw = backward(hidden, weight, rows, sc, st, need_dh=need_dh, need_dw=need_dw, dh_fp32=False)
    return grads_or_empty(hidden, weight, dh, dw)


def _forward_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, labels, temp, *scalars, entropy, settings = inputs
    lp, norm, ent = output
    ctx.save_for_backward(hidden, weight, labels, temp, norm, lp, ent if entropy else None)
    ctx.scalars, ctx.entropy, ctx.settings = tuple(scalars), entropy, settings
    ctx.set_materialize_grads(False)


def _forward_backward(ctx: Any, g_lp: Any, g_norm: Any, g_ent: Any) -> tuple[Any, ...]:
    hidden, weight, labels, temp, norm, lp, ent = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g_ent = g_ent if ctx.entropy else None
    none = (None,) * 8
    if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
        return (None, None, *none)
    dh, dw = torch.ops.fusedhead_triton.head_backward(
        hidden, weight, labels, temp, norm, lp, ent, _grad(g_lp), _grad(g_ent), *ctx.scalars,
        ctx.settings, need_dh, need_dw,
    )  # fmt: skip
    return (dh if need_dh else None, dw if need_dw else None, *none)


def _forward_fake(hidden: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    n = hidden.shape[0]
    return tuple(hidden.new_empty(s, dtype=torch.float32) for s in ((n,), (2, n), (n,)))


register_pair(
    head_forward,
    head_backward,
    forward_fake=_forward_fake,
    setup_context=_forward_setup,
    gradient=_forward_backward,
)


def head(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temp: torch.Tensor | None,
    sc: HeadScalars, key: str, entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One shard's (log_probs, entropy or None), differentiable in hidden and weight."""
    logp, _, ent = torch.ops.fusedhead_triton.head_forward(
        hidden, weight, labels, temp, sc.label_offset, sc.ignore_index, sc.inv_temp, sc.softcap,
        entropy, key,
    )  # fmt: skip
    return logp, (ent if entropy else None)
