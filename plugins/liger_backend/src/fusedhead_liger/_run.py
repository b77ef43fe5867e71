"""The contract mapped onto Liger's functions: labels in, ``(-nll, entropy in fp32)`` out.

Liger returns per-token NLL (fp32) and, when asked, entropy in the input dtype (bf16 from the
native kernel); ignored rows are 0 in both. Out-of-range labels are turned into ``ignore_index``
before Liger sees them (Liger's kernels would silently find no target logit, or stop with a
host-side check) and their rows are set to NaN afterwards, as the contract asks.

Liger computes the gradients in its forward and scales them in its backward, so a gradient of that
gradient would silently lack the second-order term: ``liger_inputs`` refuses it by name. Rows that
Liger ignores read as zeros (selected, not multiplied), so a NaN or inf hidden row whose label is
ignored cannot reach the weight gradient through ``0 * NaN`` in Liger's GEMMs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from fusedhead.second_order import first_order
from fusedhead_liger import _liger

_NAN = float("nan")
DOUBLE_BACKWARD = (
    "the liger backend's backward is not differentiable: Liger computes the gradients in its "
    "forward, so a double backward (create_graph=True, then a gradient of that gradient, e.g. a "
    "gradient penalty through the log-probs) would miss the second-order term; form such a term "
    "from full logits (hidden @ weight.T) with plain PyTorch ops"
)
#: Liger keeps this argument of the SM90 function for API compatibility; every value runs the
#: same kernel. 1 is the value Liger's own dispatcher passes by default.
M_TILES_PER_CLUSTER = 1


def guard_labels(
    labels: torch.Tensor, ignore_index: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels safe for Liger (out-of-range ones become ignore_index) and the mask of those rows."""
    bad = labels.ne(ignore_index) & ((labels < 0) | (labels >= vocab_size))
    return labels.masked_fill(bad, ignore_index), bad


class _FirstOrder(torch.autograd.Function):
    """Identity on (hidden, weight) whose backward refuses to be differentiated (``first_order``)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any]:
        ctx.save_for_backward(hidden, weight)
        return hidden.view_as(hidden), weight.view_as(weight)

    @staticmethod
    @first_order(DOUBLE_BACKWARD)
    def backward(ctx: Any, g_hidden: Any, g_weight: Any) -> tuple[Any, Any]:
        return g_hidden, g_weight


def liger_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, safe_labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, weight) as Liger gets them: behind the double-backward refusal where gradients
    are recorded, and ``hidden`` with the rows Liger ignores (``safe_labels == ignore_index``)
    selected to zeros, whose gradient is then exactly zero (one ``[N, H]`` copy)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        hidden, weight = _FirstOrder.apply(hidden, weight)  # type: ignore[no-untyped-call]
    keep = safe_labels.ne(ignore_index).unsqueeze(1)
    hidden = torch.where(keep, hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    return hidden, weight


def to_contract(
    nll: torch.Tensor, entropy: torch.Tensor | None, bad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's (nll, entropy) as fp32 (log_probs, entropy), NaN on out-of-range-label rows."""
    log_probs = torch.where(bad, _NAN, nll.neg())
    if entropy is None:
        return log_probs, None
    return log_probs, torch.where(bad, _NAN, entropy.float())


def _split(out: Any, return_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (out[0], out[1]) if return_entropy else (out, None)


def run_native(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's SM90 CuTe DSL kernel, called directly (the same call Liger's dispatcher makes).

    Liger binds the driver context of the *current* CUDA device, so the call runs with the
    inputs' device made current (a no-op in the usual one-GPU-per-process case).
    """
    fn = _liger.native_function()
    with torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext():
        out = fn.apply(
            hidden, weight, labels, temperature, ignore_index, M_TILES_PER_CLUSTER, return_entropy
        )
    return _split(out, return_entropy)


def run_fallback(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's 512-row chunked function, called directly so no device dispatch can intervene."""
    fn = _liger.fallback_function()
    out = fn.apply(hidden, weight, labels, temperature, ignore_index, return_entropy)
    return _split(out, return_entropy)


@functools.cache
def _tp_function(reduce_hidden_grad: bool) -> Any:
    """Liger's TP fallback, or a subclass whose backward keeps each rank's partial hidden gradient.

    Liger's backward sums the hidden gradient over the group (``if ctx.world_size > 1:
    all_reduce``). Megatron-style callers reduce it themselves, so for ``reduce_hidden_grad=False``
    the subclass runs Liger's forward unchanged and then records a world size of 1 on the context,
    which makes Liger's own backward skip that one all-reduce and nothing else.
    """
    base = _liger.tp_fallback_function()
    if reduce_hidden_grad:
        return base

    class _PartialHiddenGrad(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            out = base.forward(ctx, *args)
            if not hasattr(ctx, "world_size"):
                raise RuntimeError(
                    f"{_liger.TP_FALLBACK_FUNCTION} no longer records world_size; fusedhead-liger "
                    f"needs liger-kernel=={_liger.TESTED_LIGER} for reduce_hidden_grad=False"
                )
            ctx.world_size = 1
            return out

    return _PartialHiddenGrad


def run_tp_fallback(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    process_group: Any,
    reduce_hidden_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's chunked vocabulary-parallel function (equal shards, global labels)."""
    fn = _tp_function(reduce_hidden_grad)
    out = fn.apply(
        hidden.contiguous(),
        weight.contiguous(),
        labels,
        temperature,
        ignore_index,
        return_entropy,
        process_group,
    )
    return _split(out, return_entropy)
