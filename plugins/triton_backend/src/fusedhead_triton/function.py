"""The autograd Function: forward through the stats kernels, backward by vocabulary blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import launch, parallel
from .configs import BackendConfigs


@dataclass(frozen=True)
class CallSpec:
    """Everything about a call that is not a tensor."""

    scalars: launch.HeadScalars
    return_entropy: bool
    process_group: Any
    reduce_hidden_grad: bool
    configs: BackendConfigs
    backward_block_bytes: int | None
    backward_block_max_cols: int = 8192
    dh_gemm: str = "auto"
    stash_dh_sum: bool = True
    dh_sum: str = "auto"
    lend_dw_rows: bool = True


def forward_values(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temp: torch.Tensor | None,
    spec: CallSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob, lse, entropy-or-dummy) over the whole (possibly sharded) vocabulary."""
    sc = spec.scalars
    ws, zy, _ = launch.forward_partials(hidden, weight, labels, temp, sc, spec.configs.forward)
    if spec.process_group is None:
        return launch.combine(
            ws, zy, labels, sc.ignore_index, final=True, entropy=spec.return_entropy
        )
    m, s, w = launch.combine(ws, zy, labels, sc.ignore_index, final=False, entropy=False)
    del ws
    lo = sc.label_offset
    owned = (labels >= lo) & (labels < lo + weight.shape[0])
    stats, zy_all = parallel.gather_row_stats(m, s, w, zy, owned, spec.process_group)
    return launch.combine(
        stats, zy_all, labels, sc.ignore_index, final=True, entropy=spec.return_entropy
    )


class FusedHeadFunction(torch.autograd.Function):
    """log_prob (and entropy) of each row, differentiable w.r.t. hidden and weight."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        temp: torch.Tensor | None,
        spec: CallSpec,
    ) -> Any:
        logp, lse, ent = forward_values(hidden, weight, labels, temp, spec)
        ctx.set_materialize_grads(False)  # an unused output gives None: skip its term
        ctx.spec = spec
        ctx.save_for_backward(
            hidden, weight, labels, temp, lse, ent if spec.return_entropy else None
        )
        if spec.return_entropy:
            return logp, ent
        return logp

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        spec: CallSpec = ctx.spec
        hidden, weight, labels, temp, lse, ent = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp = grads[0]
        g_ent = grads[1] if spec.return_entropy else None
        if g_lp is not None:
            g_lp = g_lp.to(torch.float32).contiguous()
        if g_ent is not None:
            g_ent = g_ent.to(torch.float32).contiguous()
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        group = spec.process_group
        sum_dh = group is not None and spec.reduce_hidden_grad and need_dh
        dh, dw = launch.backward_grads(
            hidden, weight, labels, temp, lse, ent, g_lp, g_ent, spec.scalars,
            spec.configs.dz, spec.configs.dh,
            need_dh=need_dh, need_dw=need_dw,
            dh_fp32=sum_dh and hidden.dtype != torch.float32,
            block_bytes=spec.backward_block_bytes,
            block_max_cols=spec.backward_block_max_cols,
            dh_gemm=spec.dh_gemm,
            stash_dh_sum=spec.stash_dh_sum,
            dh_sum=spec.dh_sum,
            lend_dw_rows=spec.lend_dw_rows,
        )  # fmt: skip
        if sum_dh and dh is not None:
            parallel.all_reduce_sum(dh, group)
            dh = dh.to(hidden.dtype)
        return dh, dw, None, None, None
