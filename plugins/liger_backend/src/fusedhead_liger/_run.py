"""The contract mapped onto Liger's functions: labels in, ``(-nll, entropy in fp32)`` out.

Liger returns per-token NLL (fp32) and, when asked, entropy in the input dtype (bf16 from the
native kernel); ignored rows are 0 in both. Out-of-range labels are turned into ``ignore_index``
before Liger sees them (Liger's kernels would silently find no target logit, or stop with a
host-side check) and their rows are set to NaN afterwards, as the contract asks. What Liger
returns is checked for the structure the adapter reads (``split_outputs``): a changed Liger API
raises instead of broadcasting a scalar over every row.

Liger computes the gradients in its forward and scales them in its backward, so a gradient of that
gradient would silently lack the second-order term: ``liger_inputs`` refuses it by name. Rows that
Liger ignores read as zeros (selected, not multiplied), so a NaN or inf hidden row whose label is
ignored cannot reach the weight gradient through ``0 * NaN`` in Liger's GEMMs.

fp16 has a range of 65504, and Liger's chunked path keeps two things in the input dtype that can
leave it: the scaled logits ``(hidden @ weight.T) / T`` (single process), and ``dz``, the logits'
gradient, before its GEMMs. ``widen_fp16`` and ``_Adapted.backward`` keep both in range.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from fusedhead.errors import BackendContractError
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
#: fp16 inputs below this temperature may run the single-process path on fp32 copies: Liger
#: divides the fp16 GEMM output by T in fp16, which stays within fp16's range for every finite
#: logit only where T >= 1 (below it, ``|z| > 65504 * T`` overflows to inf and the row's outputs
#: are NaN). Below it, ``widen_fp16`` bounds the logits first and widens only where they could.
FP16_WIDEN_BELOW = 1.0
#: fp16's largest finite value.
FP16_MAX = 65504.0
#: The bound on ``|z / T|`` up to which fp16 inputs below T = 1 stay fp16: half fp16's range,
#: room for the roundings of the GEMM output and of the division (each 2**-11 relative).
FP16_LOGIT_LIMIT = FP16_MAX / 2
#: How the widening is declared in the fallback's capabilities (``fp16_in_fp32_where``).
FP16_WIDEN_RULE = (
    f"fp16 with T < {FP16_WIDEN_BELOW:g} where max_i |h_i| * max_v |w_v| / T > "
    f"{FP16_LOGIT_LIMIT:g} (the logits' Cauchy-Schwarz bound past half fp16's range)"
)
#: Where ``dz``'s bound is put when the upstream gradient would push it past fp16's range: a power
#: of two well under 65504, room for the GEMMs' sums (as ``fusedhead.fp16_range.TOP``).
DZ_TOP = 2.0**14


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


def logit_bound(hidden: torch.Tensor, weight: torch.Tensor) -> float:
    """``max_i |h_i| * max_v |w_v|`` (L2 norms): no logit ``h_i . w_v`` exceeds it in magnitude
    (Cauchy-Schwarz). The norms accumulate in fp32 without a copy of either tensor (a norm past
    the dtype's range reads inf, which only widens); one host read. inf or NaN where a row is."""
    if hidden.shape[0] == 0 or weight.shape[0] == 0:
        return 0.0
    norms = torch.stack(
        [
            torch.linalg.vector_norm(hidden, dim=1).amax().float(),
            torch.linalg.vector_norm(weight, dim=1).amax().float(),
        ]
    )
    h, w = norms.tolist()
    return float(h * w)


def widen_fp16(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of fp16 (hidden, weight) where ``z / T`` could leave fp16's range, else as is.

    Liger's single-process path computes ``(hidden @ weight.T) / T`` in the input dtype; in fp16
    that is inf wherever ``|z| > 65504 * T`` (logits of 38 at T = 5e-4), and the row's log-prob,
    entropy and gradients NaN. For ``T >= 1`` it cannot leave the logits' own range; below 1 the
    logits' bound (``logit_bound``, one host read) decides, and only where ``bound / T`` passes
    ``FP16_LOGIT_LIMIT`` (or is not finite) does the same Liger code run on fp32 copies, where
    ``z / T`` holds for every temperature the core takes (autograd rounds the gradients back to
    fp16). The copies cost 4 bytes x (V + N) x H and fp32 GEMMs, five times fp16's time on an
    H100 (the plugin's README).
    """
    if hidden.dtype != torch.float16 or temperature >= FP16_WIDEN_BELOW:
        return hidden, weight
    if logit_bound(hidden, weight) / temperature <= FP16_LOGIT_LIMIT:  # NaN or inf: widen
        return hidden, weight
    return hidden.float(), weight.float()


def _describe(out: Any) -> str:
    """What Liger returned, for an error: types, shapes and dtypes."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape)} ({str(out.dtype).removeprefix('torch.')})"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} ({', '.join(_describe(o) for o in out)})"
    return f"a {type(out).__name__}"


def split_outputs(
    out: Any, return_entropy: bool, rows: int, source: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's output as ``(nll, entropy or None)``, checked for the structure this adapter reads:
    ``(nll, entropy)`` with ``return_entropy``, else ``nll`` alone; each a floating ``[rows]``
    tensor, nll in fp32. Anything else (a changed Liger API: a tuple of other arity, a scalar that
    would broadcast over every row) raises ``BackendContractError`` naming liger-kernel."""
    parts = out if return_entropy and isinstance(out, tuple) else (out,)
    ok = len(parts) == (2 if return_entropy else 1) and all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == (rows,)
        for t in parts
    )
    if not ok or parts[0].dtype != torch.float32:
        expected = (
            f"(nll, entropy), each a tensor of shape [{rows}], nll in float32"
            if return_entropy
            else f"nll, a float32 tensor of shape [{rows}]"
        )
        found = _liger.distribution_version("liger-kernel")
        raise BackendContractError(
            f"liger-kernel {found}'s {source} returned {_describe(out)} for {rows} rows with "
            f"return_entropy={return_entropy}, expected {expected}; fusedhead-liger reads the "
            f"outputs of liger-kernel=={_liger.TESTED_LIGER}",
            hint=f"pip install liger-kernel=={_liger.TESTED_LIGER}",
        )
    return (parts[0], parts[1]) if return_entropy else (parts[0], None)


def to_contract(
    nll: torch.Tensor, entropy: torch.Tensor | None, bad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's (nll, entropy) as fp32 (log_probs, entropy), NaN on out-of-range-label rows.

    ``0 - nll``, not ``-nll``: an ignored row's 0 becomes +0.0, as every other backend gives it."""
    log_probs = torch.where(bad, _NAN, 0.0 - nll)
    if entropy is None:
        return log_probs, None
    return log_probs, torch.where(bad, _NAN, entropy.float())


def _upstream_scale(
    grad_nll: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    log_vocab: float,
    inv_temperature: float,
    group: Any,
    device: torch.device,
) -> float:
    """The power of two (>= 1) to divide fp16 upstream gradients by before Liger's backward.

    Liger rounds ``dz`` to fp16 before its GEMMs; per element ``|dz| <= k (|g_lp| + |g_H|
    (1/e + H))`` with ``H <= log V`` (``k``: 1/T on the TP path, which scales before rounding;
    ``max(1, 1/T)`` on the single-process path, which rounds, then divides by T in fp16). A
    GradScaler-sized upstream (65536 on an entropy bonus) overflows that rounding while the
    gradients themselves fit fp16. Dividing by ``s`` puts the bound under ``DZ_TOP``; the
    gradients are multiplied back by ``s``, exactly (a power of two). One host read; with
    ``group``, the largest scale of its ranks (every rank reaches this all-reduce), as Liger sums
    the hidden gradient over them.
    """
    top = torch.zeros((), dtype=torch.float32, device=device)
    if grad_nll is not None:
        top = top + grad_nll.detach().float().abs().amax()
    if grad_entropy is not None:
        top = top + grad_entropy.detach().float().abs().amax() * (0.5 + log_vocab)
    top = (top * inv_temperature).reshape(1)
    if group is not None:
        import torch.distributed as dist

        top = torch.nan_to_num(top, nan=math.inf)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    value = float(top)
    if not math.isfinite(value) or value <= DZ_TOP:
        return 1.0  # in range, or an upstream inf/NaN that no scale makes finite
    return math.ldexp(1.0, min(126, math.frexp(value / DZ_TOP)[1]))


@functools.cache
def adapted(base: Any, tp: bool, reduce_hidden_grad: bool = True) -> Any:
    """Liger's chunked function ``base`` as the adapter runs it: a subclass whose forward is
    Liger's, checked (``split_outputs``) and with the entropy returned in fp32, and whose backward
    is Liger's, given the fp32 upstream gradients (an fp16 entropy output would have autograd
    round its upstream gradient to fp16, where 65536 is inf) at a scale that keeps fp16 ``dz``
    in range (``_upstream_scale``).

    ``tp``: the vocabulary-parallel function, whose last argument is the process group. Liger's
    backward there sums the hidden gradient over the group (``if ctx.world_size > 1:
    all_reduce``); Megatron-style callers reduce it themselves, so ``reduce_hidden_grad=False``
    records a world size of 1 on the context after Liger's forward, which makes Liger's own
    backward skip that one all-reduce and nothing else.
    """
    name = _liger.TP_FALLBACK_FUNCTION if tp else _liger.FALLBACK_FUNCTION

    class _Adapted(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            hidden, weight, _, temperature, _, return_entropy = args[:6]
            out = base.forward(ctx, *args)
            nll, entropy = split_outputs(out, return_entropy, hidden.shape[0], name)
            group = args[6] if tp else None
            world = 1
            if group is not None:
                import torch.distributed as dist

                world = dist.get_world_size(group)
                if not reduce_hidden_grad:
                    if not hasattr(ctx, "world_size"):
                        raise BackendContractError(
                            f"{name} no longer records world_size; fusedhead-liger needs "
                            f"liger-kernel=={_liger.TESTED_LIGER} for reduce_hidden_grad=False",
                            hint=f"pip install liger-kernel=={_liger.TESTED_LIGER}",
                        )
                    ctx.world_size = 1
            ctx.fusedhead_fp16 = hidden.dtype == torch.float16
            if ctx.fusedhead_fp16:
                ctx.fusedhead_log_vocab = math.log(weight.shape[0] * world)
                # Liger scales dz by 1/T before rounding it on the TP path; the single-process
                # path rounds it, then divides in fp16: both must fit, so k = max(1, 1/T).
                ctx.fusedhead_inv_t = 1.0 / temperature if tp else max(1.0, 1.0 / temperature)
                ctx.fusedhead_group = group if world > 1 and reduce_hidden_grad else None
                ctx.fusedhead_device = hidden.device
            return (nll, entropy.float()) if entropy is not None else nll

        @staticmethod
        def backward(ctx: Any, grad_nll: Any, grad_entropy: Any = None) -> Any:
            scale = 1.0
            if ctx.fusedhead_fp16:
                scale = _upstream_scale(
                    grad_nll,
                    grad_entropy,
                    ctx.fusedhead_log_vocab,
                    ctx.fusedhead_inv_t,
                    ctx.fusedhead_group,
                    ctx.fusedhead_device,
                )
            if scale != 1.0:
                grad_nll = None if grad_nll is None else grad_nll / scale
                grad_entropy = None if grad_entropy is None else grad_entropy / scale
            grads = base.backward(ctx, grad_nll, grad_entropy)
            if scale != 1.0:
                for g in grads[:2]:
                    if g is not None:
                        g.mul_(scale)  # a power of two: exact, short of fp16's own overflow
            return grads

    _Adapted.__name__ = _Adapted.__qualname__ = f"Adapted{base.__name__}"
    return _Adapted


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
    return split_outputs(out, return_entropy, hidden.shape[0], _liger.NATIVE_FUNCTION)


def run_fallback(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Liger's 512-row chunked function, called directly so no device dispatch can intervene."""
    fn = adapted(_liger.fallback_function(), tp=False)
    hidden, weight = widen_fp16(hidden, weight, temperature)
    out = fn.apply(hidden, weight, labels, temperature, ignore_index, return_entropy)
    return (out[0], out[1]) if return_entropy else (out, None)


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
    """Liger's chunked vocabulary-parallel function (equal shards, global labels). It divides
    the logits by T in fp32, so fp16 needs no ``widen_fp16`` here."""
    fn = adapted(_liger.tp_fallback_function(), tp=True, reduce_hidden_grad=reduce_hidden_grad)
    out = fn.apply(
        hidden.contiguous(),
        weight.contiguous(),
        labels,
        temperature,
        ignore_index,
        return_entropy,
        process_group,
    )
    return (out[0], out[1]) if return_entropy else (out, None)
