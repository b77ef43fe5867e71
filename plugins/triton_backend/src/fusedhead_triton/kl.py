"""The KL of two heads on the triton backend: launchers and the autograd boundary.

``fusedhead_triton::kl_forward`` (one pass over the vocabulary computing both heads' tiles, then a
fixed-order combine) and ``fusedhead_triton::kl_backward`` (the student's ``dz`` from both
recomputed tiles, driven block by block by ``backward.backward_from``) are ``torch.library``
custom ops with fake implementations, so ``torch.compile(fullgraph=True)`` traces them. Gradients
reach the student's hidden states and weight only; the teacher is read, never differentiated.
Memory: the chunks' statistics ``[5, C, N]`` (``C`` = V / (BLOCK_N * CHUNK)) in the forward, then
``O(N)`` saved (``norm [5, N]``: both heads' row max and ``log2 s``, kept apart, and the cross
term's mean); the backward's the driver's dz blocks and an fp32 ``[N, H]`` dh sum (``Dense``).
"""

# No ``from __future__ import annotations``: torch.library reads the annotations as types.

import math
from dataclasses import dataclass
from typing import Any

import torch

from fusedhead.protocol import KLCall, KLOutput

from .backward import Dense, backward_from
from .configs import Settings, TileConfig, kl_tile
from .custom_ops import grads_or_empty, register_pair
from .kernels.kl import kl_combine_kernel, kl_dz_kernel, kl_stats_kernel
from .launch import (
    COMBINE_BLOCK_R,
    COMBINE_BLOCK_T,
    descriptor,
    num_programs,
    precision,
    tma_usable,
)

#: Vocabulary tiles a forward program folds into one set of statistics (fixed: batch invariance);
#: the workspace is 5 x N x V / (BLOCK_N x CHUNK) fp32 values.
CHUNK = 4


@dataclass(frozen=True)
class KLScalars:
    """Per-call scalars of both heads (a head's ``inv_temp`` is unused when its temperature is a
    per-token tensor)."""

    inv_temp: float
    teacher_inv_temp: float
    softcap: float | None
    teacher_softcap: float | None
    reverse: bool

    def args(self) -> tuple[float, ...]:
        """The kernels' scalar arguments: both inverse temperatures, then (c, 1/c) of each head."""
        caps: list[float] = []
        for c in (self.softcap, self.teacher_softcap):
            caps += (c, 1.0 / c) if c is not None else (0.0, 0.0)
        return (self.inv_temp, self.teacher_inv_temp, *caps)


def _flags(cfg: TileConfig, hs: torch.Tensor, ht: torch.Tensor, temps: tuple[Any, Any],
           sc: KLScalars) -> tuple[bool, dict[str, Any]]:  # fmt: skip
    """(TMA or pointers, the constexpr arguments shared by the stats and dz kernels)."""
    dev, dtype = hs.device, hs.dtype
    tma = tma_usable(cfg, dtype, hs.shape[1], dev) and tma_usable(cfg, dtype, ht.shape[1], dev)
    flags = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGS=num_programs(dev), TMA=tma, EVEN_KS=hs.shape[1] % cfg.block_k == 0,
        EVEN_KT=ht.shape[1] % cfg.block_k == 0, PRECISION=precision(dtype),
        PER_TOKEN_TS=temps[0] is not None, PER_TOKEN_TT=temps[1] is not None,
        SOFTCAP_S=sc.softcap is not None, SOFTCAP_T=sc.teacher_softcap is not None,
        REVERSE=sc.reverse, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return tma, flags


def _operands(tma: bool, cfg: TileConfig, *pairs: tuple[torch.Tensor, torch.Tensor]) -> list[Any]:
    """Each (hidden, weight block) pair as TMA descriptors or as the tensors themselves."""
    if not tma:
        return [t for pair in pairs for t in pair]
    out: list[Any] = []
    for h, w in pairs:
        out += [
            descriptor(h, [cfg.block_m, cfg.block_k]),
            descriptor(w, [cfg.block_n, cfg.block_k]),
        ]
    return out


def _strides(*ts: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for t in ts for s in t.stride())


def kl_values(
    hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor, valid: torch.Tensor,
    temp_s: torch.Tensor | None, temp_t: torch.Tensor | None, sc: KLScalars, cfg: TileConfig,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kl fp32 [N], ``norm`` fp32 [5, N]: the student's row max of ``z log2(e)`` and ``log2 s``,
    the teacher's, and the cross term's mean, ``kernels.kl.kl_combine_kernel``): one pass over
    the vocabulary, then the combine (``chunk``: a tuning knob for tools/kl_sweep.py, never
    dependent on N)."""
    n, v, dev = hs.shape[0], ws.shape[0], hs.device
    chunks = math.ceil(math.ceil(v / cfg.block_n) / chunk)
    outs = _outputs(hs)
    if n == 0:
        return outs
    part = torch.empty((5, chunks, n), dtype=torch.float32, device=dev)
    tma, flags = _flags(cfg, hs, ht, (temp_s, temp_t), sc)
    items = math.ceil(n / cfg.block_m) * chunks
    dummy = outs[0]  # a temperature pointer never read without its PER_TOKEN flag
    kl_stats_kernel[(min(flags["NUM_PROGS"], items),)](
        *_operands(tma, cfg, (hs, ws), (ht, wt)),
        dummy if temp_s is None else temp_s, dummy if temp_t is None else temp_t, part, n, v,
        hs.shape[1], ht.shape[1], *_strides(hs, ws, ht, wt), *sc.args(), CHUNK=chunk, **flags,
    )  # fmt: skip
    kl_combine_kernel[(math.ceil(n / COMBINE_BLOCK_R),)](
        part, valid.view(torch.uint8), *outs, n, chunks, BLOCK_R=COMBINE_BLOCK_R,
        BLOCK_T=COMBINE_BLOCK_T, REVERSE=sc.reverse, num_warps=4,
    )  # fmt: skip
    return outs


def _outputs(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (kl [N], norm [5, N]), fp32: the forward op's outputs and its fake's."""
    n = hidden.shape[0]
    return tuple(hidden.new_empty(shape, dtype=torch.float32) for shape in (n, (5, n)))  # type: ignore[return-value]


def kl_grads(
    hs: torch.Tensor, ws: torch.Tensor, ht: torch.Tensor, wt: torch.Tensor,
    temp_s: torch.Tensor | None, temp_t: torch.Tensor | None, norm: torch.Tensor,
    coef: torch.Tensor, sc: KLScalars, st: Settings,
    cfg: TileConfig, *, need_dh: bool, need_dw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """The student's (dh, dW) for the upstream gradient ``coef`` (0 on ignored rows)."""
    tma, flags = _flags(cfg, hs, ht, (temp_s, temp_t), sc)
    n = hs.shape[0]
    row_args = (temp_s if temp_s is not None else coef, temp_t if temp_t is not None else coef,
                norm, coef)  # fmt: skip

    def fill_dz(v0: int, dz: torch.Tensor) -> None:
        cols = dz.shape[1]
        wsb, wtb = ws[v0 : v0 + cols], wt[v0 : v0 + cols]
        ops = _operands(tma, cfg, (hs, wsb), (ht, wtb))
        out = descriptor(dz, [cfg.block_m, cfg.block_n]) if tma else dz
        tiles = math.ceil(n / cfg.block_m) * math.ceil(cols / cfg.block_n)
        kl_dz_kernel[(min(flags["NUM_PROGS"], tiles),)](
            *ops[:2], *ops[2:], out, *row_args, n, cols, hs.shape[1], ht.shape[1],
            *_strides(hs, wsb, ht, wtb), dz.stride(0), *sc.args(), **flags,
        )  # fmt: skip

    dense = Dense(cfg.block_m, cfg.block_n, flags["NUM_PROGS"])
    # rows whose coef is 0 (ignored ones) get dz 0 and are read as zero rows by the dW GEMMs
    return backward_from(hs, ws, fill_dz, st, need_dh=need_dh, need_dw=need_dw, dh_fp32=False,
                         dense=dense, valid=coef != 0)  # fmt: skip


@torch.library.custom_op("fusedhead_triton::kl_forward", mutates_args=())
def kl_forward(
    hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor, valid: torch.Tensor, temp: torch.Tensor | None,
    teacher_temp: torch.Tensor | None, inv_temp: float, teacher_inv_temp: float,
    softcap: float | None, teacher_softcap: float | None, reverse: bool, settings: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kl fp32 [N], norm fp32 [5, N]; ``kl_values``)."""
    sc = KLScalars(inv_temp, teacher_inv_temp, softcap, teacher_softcap, reverse)
    cfg = kl_tile(Settings.from_key(settings).forward)
    return kl_values(hidden, weight, teacher_hidden, teacher_weight, valid, temp, teacher_temp,
                     sc, cfg)  # fmt: skip


@torch.library.custom_op("fusedhead_triton::kl_backward", mutates_args=())
def kl_backward(
    hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor, temp: torch.Tensor | None, teacher_temp: torch.Tensor | None,
    norm: torch.Tensor, coef: torch.Tensor,
    inv_temp: float, teacher_inv_temp: float, softcap: float | None,
    teacher_softcap: float | None, reverse: bool, settings: str, need_dh: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The student's (dh, dW); an empty tensor for a gradient not asked."""
    sc = KLScalars(inv_temp, teacher_inv_temp, softcap, teacher_softcap, reverse)
    st = Settings.from_key(settings)
    dh, dw = kl_grads(
        hidden, weight, teacher_hidden, teacher_weight, temp, teacher_temp, norm,
        coef, sc, st, kl_tile(st.dz), need_dh=need_dh, need_dw=need_dw,
    )  # fmt: skip
    return grads_or_empty(hidden, weight, dh, dw)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hs, ws, ht, wt, valid, temp, teacher_temp, *scalars, settings = inputs
    ctx.save_for_backward(hs, ws, ht, wt, valid, temp, teacher_temp, output[1])  # norm
    ctx.scalars, ctx.settings = tuple(scalars), settings
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, g_kl: Any, g_norm: Any) -> tuple[Any, ...]:
    hs, ws, ht, wt, valid, temp, teacher_temp, norm = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * 11
    if g_kl is None or not (need_dh or need_dw):
        return (None, None, *none)
    coef = torch.where(valid, g_kl.to(torch.float32), 0.0).contiguous()
    dh, dw = torch.ops.fusedhead_triton.kl_backward(
        hs, ws, ht, wt, temp, teacher_temp, norm, coef, *ctx.scalars,
        ctx.settings, need_dh, need_dw,
    )  # fmt: skip
    return (dh if need_dh else None, dw if need_dw else None, *none)


def _forward_fake(hidden: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(hidden)


register_pair(
    kl_forward, kl_backward, forward_fake=_forward_fake, setup_context=_setup, gradient=_backward
)


def _temperature(arg: str, t: float | torch.Tensor, n: int, device: torch.device
                 ) -> tuple[torch.Tensor | None, float]:  # fmt: skip
    """(per-token fp32 [N] temperatures or None, the scalar 1/T) of one head."""
    if not isinstance(t, torch.Tensor):
        return None, 1.0 / float(t)
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{arg}: the triton backend does not differentiate w.r.t. a per-token temperature; "
            f"pass {arg}.detach()"
        )
    return t.detach().to(device=device, dtype=torch.float32).expand(n).contiguous(), 1.0


def kl(call: KLCall, key: str) -> KLOutput:
    """The per-token KL of ``call`` with the settings ``key`` (the backend's, for this dtype)."""
    hs, ht, dev = call.hidden, call.teacher_hidden, call.hidden.device
    n = hs.shape[0]
    temp, inv = _temperature("temperature", call.temperature, n, dev)
    t_temp, t_inv = _temperature("teacher_temperature", call.teacher_temperature, n, dev)
    softcap, teacher_softcap = call.softcap, call.teacher_softcap
    kl_out, _ = torch.ops.fusedhead_triton.kl_forward(
        hs.contiguous(), call.weight, ht.detach().contiguous(), call.teacher_weight.detach(),
        call.valid.contiguous(), temp, t_temp, inv, t_inv,
        None if softcap is None else float(softcap),
        None if teacher_softcap is None else float(teacher_softcap),
        call.direction == "reverse", key,
    )  # fmt: skip
    return KLOutput(kl_out)
