"""The fp32 math on one logit tile ``x = h_rows @ W_block.T``: forward statistics and backward dz.

Each function takes the tile as the GEMM wrote it (the input dtype, or fp32 with ``fp32_logits``).
The scaled logits are formed by a plain product ``z = k * src`` (correctly rounded everywhere, no
fused multiply-add), and a row's max is that same product of the row's largest ``src``: so the
largest entry gets ``d = z - m = 0`` exactly at any temperature (a fused ``k * src - m`` is off by
the rounding of ``m``, about ``u |z|``, which at ``T = 1e-10`` is thousands and zeroed whole rows).
Products that could overflow are formed in a bounded order (``e * d`` before a per-row factor).
fp32 tiles are worked in place; the label column is patched with a gather and a scatter (no host
sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedhead_torch.fused_passes import compiled, label_grad
from fusedhead_torch.rowstats import RowStats
from fusedhead_torch.tiling import Tiles

FP32 = torch.float32
#: Largest ``1 / T`` (and ``c / T``) used: 2^100 ~ 1.3e30, so ``k * (src - max)`` stays finite for
#: raw logit gaps under ~2.7e8. Temperatures below 7.9e-31 are refused (the backend's min_temperature).
MAX_SCALE = 2.0**100
#: Largest ``c / T`` folded into one factor with a softcap ``c``: ``src = tanh(x / c)`` lies in
#: [-1, 1], so ``k * (src - max)`` stays finite up to 2^126. Past it (a cap of 1e34 at T = 1e-4)
#: ``c`` is applied to ``src`` itself and ``k`` is ``1 / T``, as without a softcap.
MAX_SOFTCAP_SCALE = 2.0**126


def clamp_scale(k: float | torch.Tensor) -> float | torch.Tensor:
    """``k`` limited to ``MAX_SCALE`` (a Python float stays one; a tensor is clamped)."""
    if isinstance(k, torch.Tensor):
        return k.clamp(max=MAX_SCALE)
    return min(k, MAX_SCALE)


def inverse_temperature(
    temperature: float | torch.Tensor, scored: torch.Tensor
) -> float | torch.Tensor:
    """``1 / T`` clamped to ``MAX_SCALE``: a float, or fp32 ``[N]`` for a per-token temperature,
    where a row that is not ``scored`` (``[N]`` bool) gets 1.

    An ignored row's temperature is never read: an unchecked call (``check_labels=False``) may
    hold NaN there, and one NaN factor would reach every gradient through ``0 * NaN`` in the
    backward's tiles (a finite 1 keeps that row's zeros exact, as zeroed hidden rows do).
    """
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach().to(device=scored.device, dtype=FP32)
        return clamp_scale(torch.where(scored, t.reciprocal(), 1.0))
    return clamp_scale(1.0 / float(temperature))


class Workspace:
    """Flat buffers reused by every tile of a call, each viewed at the tile's shape."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self._numel = numel
        self._device = device
        self._flat: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def get(self, slot: int, rows: int, cols: int, dtype: torch.dtype = FP32) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` view of buffer ``slot`` (fp32 unless ``dtype``)."""
        flat = self._flat.get((slot, dtype))
        if flat is None:
            flat = torch.empty(self._numel, dtype=dtype, device=self._device)
            self._flat[(slot, dtype)] = flat
        return flat[: rows * cols].view(rows, cols)


#: ``mm_out_dtype_works`` per (device, dtype): a plain dict, which torch.compile reads as a
#: constant (it would trace a ``functools.cache``'d function's body, the trial GEMM included).
_MM_OUT_DTYPE: dict[tuple[torch.device, torch.dtype], bool] = {}


#: Per device, False once ``torch.mm(..., out_dtype=..., out=...)`` has failed (then: a copy).
_MM_OUT_DTYPE_INTO: dict[torch.device, bool] = {}


def mm_out_dtype_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` on ``device``."""
    works = _MM_OUT_DTYPE.get((device, dtype))
    if works is None:
        works = _MM_OUT_DTYPE[(device, dtype)] = _try_mm_out_dtype(device, dtype)
    return works


def _try_mm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """One trial GEMM with ``out_dtype`` (CUDA only; torch >= 2.8 has ``aten::mm.dtype``)."""
    if device.type != "cuda" or not hasattr(torch.ops.aten.mm, "dtype"):
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return bool(torch.mm(a, a, out_dtype=FP32).dtype == FP32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def gemm_operand(t: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``t`` as the logits GEMMs take it: upcast once where fp32 logits need upcast operands."""
    if fp32 and t.dtype != FP32 and not mm_out_dtype_works(t.device, t.dtype):
        return t.float()
    return t


def logits_mm(
    a: torch.Tensor, b: torch.Tensor, fp32: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b`` through the dispatcher; with ``fp32``, accumulated *and written* in fp32.

    fp32 output of fp16/bf16 inputs: ``aten::mm.dtype`` where torch has it for the device (CUDA,
    torch >= 2.8: the same tensor-core GEMM, an fp32 epilogue); otherwise both operands upcast
    (see ``gemm_operand``) and an fp32 ``aten::mm``: exact products either way, since fp16/bf16
    values are exact in fp32 (and in TF32, should the caller allow it). ``out``: a view to write
    into (a column slice of a wider tile), of the dtype the GEMM writes.
    """
    if not fp32 or (a.dtype == FP32 and b.dtype == FP32):
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    if a.dtype == b.dtype and mm_out_dtype_works(a.device, a.dtype):
        if out is None:
            return torch.mm(a, b, out_dtype=FP32)
        if _MM_OUT_DTYPE_INTO.get(a.device, True):
            try:
                return torch.mm(a, b, out_dtype=FP32, out=out)
            except (RuntimeError, NotImplementedError, TypeError):
                _MM_OUT_DTYPE_INTO[a.device] = False  # a torch without aten::mm.dtype_out
        return out.copy_(torch.mm(a, b, out_dtype=FP32))
    return (
        torch.mm(a.float(), b.float()) if out is None else torch.mm(a.float(), b.float(), out=out)
    )


def forward_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: tuple[int, int],
    cols: tuple[int, int],
    grid: Tiles,
    fp32: bool,
) -> torch.Tensor:
    """The logits of ``rows`` x ``cols`` with the forward's bits: from GEMMs of its tiles' shapes.

    The forward walks ``grid`` (the vocabulary grid); the backward's tiles are wider. A GEMM's
    rounding may depend on its shape (MKL's fp32 GEMM on an AMD EPYC gives another last bit to
    a logit computed among 16 columns than among 70), and the backward divides the recomputed
    ``exp(k x - m)`` by the forward's sums: at a small temperature one ulp of ``x`` is thousands
    in ``k x``. So each forward tile the block meets is computed as the forward computed it and
    written into the block; one that reaches past the block is computed whole and its overlap
    kept (only with explicit tile sizes off the grid: the auto plans nest).
    """
    (r0, r1), (v0, v1) = rows, cols
    row_parts = [(a, b) for a, b in grid.row_ranges(h.shape[0]) if a < r1 and b > r0]
    col_parts = [(c, d) for c, d in grid.col_ranges(weight.shape[0]) if c < v1 and d > v0]
    if row_parts == [rows] and col_parts == [cols]:
        return logits_mm(h[r0:r1], weight[v0:v1].T, fp32)
    dtype = FP32 if fp32 or h.dtype == FP32 else h.dtype  # what logits_mm writes
    x = torch.empty(r1 - r0, v1 - v0, dtype=dtype, device=h.device)
    into = not torch.compiler.is_compiling()  # Dynamo takes no non-contiguous out=: a copy
    for a, b in row_parts:
        for c, d in col_parts:
            if into and r0 <= a and b <= r1 and v0 <= c and d <= v1:
                logits_mm(h[a:b], weight[c:d].T, fp32, out=x[a - r0 : b - r0, c - v0 : d - v0])
                continue
            y = logits_mm(h[a:b], weight[c:d].T, fp32)
            ra, rb, ca, cb = max(a, r0), min(b, r1), max(c, v0), min(d, v1)
            x[ra - r0 : rb - r0, ca - v0 : cb - v0].copy_(y[ra - a : rb - a, ca - c : cb - c])
    return x


@dataclass(frozen=True)
class Scaling:
    """Maps raw logits ``x`` to ``src`` (``x``, or ``tanh(x / c)`` with a softcap) and ``z = k src``.

    ``inv_t`` is ``1 / temperature`` (clamped to ``MAX_SCALE``): a float, or an fp32 ``[N]`` tensor
    for per-token temperature. With a softcap ``c``, ``z = c * tanh(x / c) / T`` and ``k = c / T``
    (``folded``; past ``MAX_SOFTCAP_SCALE``, ``src`` carries ``c`` and ``k = 1 / T``).
    """

    inv_t: float | torch.Tensor
    softcap: float | None = None

    @property
    def folded(self) -> bool:
        """Whether ``c`` is folded into ``k`` (``src = tanh(x / c)``, ``k = c / T``): whenever
        ``c / T`` stays within ``MAX_SOFTCAP_SCALE`` (a per-token ``1 / T`` is at most
        ``MAX_SCALE``). Otherwise ``src = c tanh(x / c)`` and ``k = 1 / T``: the same ``k src``."""
        if self.softcap is None:
            return False
        most = MAX_SCALE if isinstance(self.inv_t, torch.Tensor) else self.inv_t
        return self.softcap * most <= MAX_SOFTCAP_SCALE

    def rows(self, start: int, stop: int) -> float | torch.Tensor:
        """``k`` for rows ``[start, stop)``: the factor that multiplies ``src``."""
        k = self.inv_t[start:stop] if isinstance(self.inv_t, torch.Tensor) else self.inv_t
        c = self.softcap
        return k * c if c is not None and self.folded else k

    def inv_t_rows(self, start: int, stop: int) -> float | torch.Tensor:
        """``1 / T`` for rows ``[start, stop)``."""
        return self.inv_t[start:stop] if isinstance(self.inv_t, torch.Tensor) else self.inv_t

    def source(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``src`` of a tile in fp32: ``x`` itself (no softcap) or ``tanh(x / c)`` into ``out``."""
        if self.softcap is None:
            return x
        # A [1, 1] fp32 factor (not a Python float) makes a bf16/fp16 tile compute in fp32.
        inv_c = torch.full((1, 1), 1.0 / self.softcap, dtype=FP32, device=x.device)
        src = torch.mul(x, inv_c, out=out).tanh_()
        return src if self.folded else src.mul_(self.softcap)

    def sech2(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``1 - tanh(x / c)^2`` of a tile in fp32 into ``out``, as ``1 / cosh(x / c)^2``: the
        softcap's derivative to fp32 relative precision at any ``x`` (``1 - tanh^2`` from the
        rounded tanh cancels once the cap saturates; past ``|x / c|`` 89 it is 0, as it rounds)."""
        inv_c = torch.full((1, 1), 1.0 / float(self.softcap or 1.0), dtype=FP32, device=x.device)
        return torch.mul(x, inv_c, out=out).cosh_().square_().reciprocal_()


def scale_factor(k: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``k`` as an fp32 tensor broadcasting over a tile's columns (``[R, 1]`` or ``[1, 1]``).

    A tensor, not a Python float, so that a bf16/fp16 tile is multiplied in fp32, and the row max
    and the tile are multiplied by the very same fp32 value.
    """
    if isinstance(k, torch.Tensor):
        return k.to(FP32).unsqueeze(1)
    return torch.full((1, 1), k, dtype=FP32, device=device)


def offsets(
    src: torch.Tensor, k_col: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``d = k * src - row_max[:, None]`` in fp32 (``out`` may be ``src``): two rounded ops.

    ``row_max`` must be ``k * max(src)`` as ``scale_factor`` multiplies, so the max gives 0.
    """
    return torch.mul(src, k_col, out=out).sub_(row_max.unsqueeze(1))


def recomputed_offsets(
    src: torch.Tensor, k_col: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``offsets`` of a recomputed tile against the forward's row max, clamped to ``d <= 0``.

    A backward GEMM of another width may round a logit differently from the forward's (CPU and
    cuBLAS kernels change with the shape): ``d = k (x' - x)`` is then positive, ``u |z|`` in
    size, which at tiny temperatures is thousands, ``exp(d)`` inf and the gradient NaN. Every
    ``d`` is at most 0 by definition; the clamp keeps ``p <= 1``.
    """
    return offsets(src, k_col, row_max, out).clamp_(max=0.0)


def affine(
    src: torch.Tensor, k: float | torch.Tensor, shift: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out = src * k + shift[:, None]`` computed in fp32 in one pass (``out`` may be ``src``)."""
    if isinstance(k, torch.Tensor):
        return torch.addcmul(shift.unsqueeze(1), src, k.unsqueeze(1), out=out)
    return torch.add(shift.unsqueeze(1), src, alpha=k, out=out)


def row_dot_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b, dim=1)``; overwrites ``a`` (no ``[R, C]`` temporary)."""
    return a.mul_(b).sum(dim=1)


def forward_tile(
    x: torch.Tensor,
    label_col: torch.Tensor,
    k: float | torch.Tensor,
    scaling: Scaling,
    ws: Workspace,
    with_entropy: bool,
) -> tuple[RowStats, torch.Tensor]:
    """Row statistics of one tile and each row's scaled logit at ``label_col`` (clamped in range).

    Passes over the tile: [tanh,] max, scale into fp32 (in place for fp32), subtract, exp, sum, and
    for entropy one more product-and-sum.
    """
    rows, cols = x.shape
    col = label_col.unsqueeze(1)
    low = x.dtype != FP32
    k_col = scale_factor(k, x.device)
    src = scaling.source(x, out=ws.get(0, rows, cols) if low else x)
    m = (src.amax(dim=1, keepdim=True).float() * k_col).squeeze(1)
    z_label = (src.gather(1, col).float() * k_col).squeeze(1)
    d = offsets(src, k_col, m, out=src if src.dtype == FP32 else ws.get(0, rows, cols))
    if not with_entropy:
        s = d.exp_().sum(dim=1)
        return RowStats(m, s, torch.zeros_like(s)), z_label
    e = torch.exp(d, out=ws.get(1, rows, cols))
    s = e.sum(dim=1)
    t = row_dot_(d, e)  # each e * d is at most 1/e in size, whatever k is
    return RowStats(m, s, t), z_label


def patch_label(
    dz: torch.Tensor, col: torch.Tensor, in_block: torch.Tensor, dz_label: torch.Tensor
) -> torch.Tensor:
    """``dz`` with each row's label column (``col`` ``[R, 1]``) set to ``dz_label`` where the
    label lies in this block (a gather and a scatter: no host sync)."""
    current = dz.gather(1, col).squeeze(1)
    patched = torch.where(in_block, dz_label.to(dz.dtype), current)
    return dz.scatter_(1, col, patched.unsqueeze(1))


def backward_tile(
    x: torch.Tensor,
    label_col: torch.Tensor,
    in_block: torch.Tensor,
    k: float | torch.Tensor,
    scaling: Scaling,
    ws: Workspace,
    row_max: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor | None,
    label_term: torch.Tensor,
    dz_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dz`` of one tile in ``dz_dtype`` (default ``x.dtype``), for the two gradient GEMMs.

    ``row_max`` is the forward's ``m`` (scaled). With ``d = k src - m`` and ``e = exp(d)``: ``dz = (a e + b (e d)) [* sech^2(x / c)] + onehot
    * label_term``, where the per-row ``a``, ``b`` and ``label_term`` fold in the upstream gradients,
    ``1 / T`` and the softmax normaliser (see ``chunked._coefficients``). ``e d`` is formed first:
    ``b d`` alone can overflow at tiny temperatures where ``e`` is 0.
    """
    rows, cols = x.shape
    col = label_col.unsqueeze(1)
    low = x.dtype != FP32
    out_dtype = x.dtype if dz_dtype is None else dz_dtype
    capped = scaling.softcap is not None
    if capped:
        sech2 = scaling.sech2(x, out=ws.get(4, rows, cols))  # before src may overwrite x
        src = scaling.source(x, out=ws.get(0, rows, cols) if low else x)
        d_out, e_out = ws.get(1, rows, cols), ws.get(2, rows, cols)
    else:
        src = x
        d_out, e_out = (ws.get(0, rows, cols) if low else x), ws.get(1, rows, cols)
    d = recomputed_offsets(src, scale_factor(k, x.device), row_max, out=d_out)
    e = torch.exp(d, out=e_out)
    e_label = e.gather(1, col).squeeze(1)
    if out_dtype == FP32:
        dz_out = e  # worked in place
    elif x.dtype == out_dtype:
        dz_out = x  # the GEMM's own buffer, free once src and d are formed
    else:
        dz_out = ws.get(3, rows, cols, out_dtype)
    # The last product of each branch writes dz_out; a softcap first needs the fp32 values.
    final = e if capped else dz_out
    a_col = coef_a.unsqueeze(1)
    dz_label = torch.addcmul(label_term, e_label, coef_a)
    if coef_b is not None:
        ed = d.mul_(e)
        dz_label.addcmul_(ed.gather(1, col).squeeze(1), coef_b)
        g = torch.addcmul(e.mul_(a_col), ed, coef_b.unsqueeze(1), out=final)
    else:
        g = torch.mul(e, a_col, out=final)
    if capped:
        dz_label = dz_label * sech2.gather(1, col).squeeze(1)
        dz = torch.mul(g, sech2, out=dz_out)
    else:
        dz = g
    return patch_label(dz, col, in_block, dz_label)


def compiled_backward_tile(
    x: torch.Tensor,
    label_col: torch.Tensor,
    in_block: torch.Tensor,
    k: float | torch.Tensor,
    row_max: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    dz_dtype: torch.dtype,
) -> torch.Tensor:
    """``backward_tile``'s ``dz`` (no softcap) in one compiled pass over the tile
    (``fused_passes.logits_grad``: ``e a + (e d) b``), the label column patched after, as there."""
    coef_a, coef_b, label_term = coefs
    b = torch.zeros_like(coef_a) if coef_b is None else coef_b
    k_col = scale_factor(k, x.device)
    col = label_col.unsqueeze(1)
    variant = (x.device.type, x.dtype, dz_dtype, k_col.shape[0] > 1)
    dz: torch.Tensor = compiled("logits_grad", *variant)(x, k_col, row_max, coef_a, b, dz_dtype)
    d_y = ((x.gather(1, col).float() * k_col).squeeze(1) - row_max).clamp_(max=0.0)
    e_y = torch.exp(d_y)
    dz_label = label_grad(e_y, d_y, coef_a, b, label_term)
    return patch_label(dz, col, in_block, dz_label)
