"""The fp32 math on one logit tile ``x = h_rows @ W_block.T``: forward statistics and backward dz.

Each function takes the tile as the GEMM wrote it (input dtype) and makes as few passes over it as
it can: the temperature (and softcap scale) and the max subtraction fold into one pass that also
upcasts; fp32 tiles are worked in place; the label column is patched with a gather and a scatter
(no host sync, no out-of-range index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedhead_torch.rowstats import RowStats

FP32 = torch.float32


class Workspace:
    """Flat fp32 buffers reused by every tile of a call, each viewed at the tile's shape."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self._numel = numel
        self._device = device
        self._flat: dict[int, torch.Tensor] = {}

    def get(self, slot: int, rows: int, cols: int) -> torch.Tensor:
        """A contiguous fp32 ``[rows, cols]`` view of buffer ``slot``."""
        flat = self._flat.get(slot)
        if flat is None:
            flat = torch.empty(self._numel, dtype=FP32, device=self._device)
            self._flat[slot] = flat
        return flat[: rows * cols].view(rows, cols)


@dataclass(frozen=True)
class Scaling:
    """Maps raw logits ``x`` to scaled logits ``z = k * src``, ``src = x`` or ``tanh(x / c)``.

    ``inv_t`` is ``1 / temperature``: a float, or an fp32 ``[N]`` tensor for per-token temperature.
    With a softcap ``c``, ``z = c * tanh(x / c) / T`` and ``k = c / T``.
    """

    inv_t: float | torch.Tensor
    softcap: float | None = None

    def rows(self, start: int, stop: int) -> float | torch.Tensor:
        """``k`` for rows ``[start, stop)``: the factor that multiplies ``src``."""
        c = 1.0 if self.softcap is None else self.softcap
        if isinstance(self.inv_t, torch.Tensor):
            k = self.inv_t[start:stop]
            return k if self.softcap is None else k * c
        return self.inv_t * c

    def inv_t_rows(self, start: int, stop: int) -> float | torch.Tensor:
        """``1 / T`` for rows ``[start, stop)``."""
        return self.inv_t[start:stop] if isinstance(self.inv_t, torch.Tensor) else self.inv_t

    def source(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``src`` of a tile in fp32: ``x`` itself (upcast only if ``out`` is not ``x``) or tanh."""
        if self.softcap is None:
            return x
        # A [1, 1] fp32 factor (not a Python float) makes a bf16/fp16 tile compute in fp32.
        inv_c = torch.full((1, 1), 1.0 / self.softcap, dtype=FP32, device=x.device)
        return torch.mul(x, inv_c, out=out).tanh_()

    def scaled(self, raw: torch.Tensor, k: float | torch.Tensor) -> torch.Tensor:
        """``z`` of a few raw fp32 values, one per row (the same formula as the tiles)."""
        if self.softcap is not None:
            raw = torch.tanh(raw * (1.0 / self.softcap))
        return raw * k


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

    Passes over the tile: max (input dtype), scale-and-shift into fp32 (in place for fp32), exp,
    sum, and for entropy one more product-and-sum.
    """
    rows, cols = x.shape
    col = label_col.unsqueeze(1)
    x_max = x.amax(dim=1).float()
    x_label = x.gather(1, col).squeeze(1).float()
    src = scaling.source(x, out=x if x.dtype == FP32 else ws.get(0, rows, cols))
    m = scaling.scaled(x_max, k)
    z_label = scaling.scaled(x_label, k)
    d = affine(src, k, -m, out=src if src.dtype == FP32 else ws.get(0, rows, cols))
    if not with_entropy:
        s = d.exp_().sum(dim=1)
        return RowStats(m, s, torch.zeros_like(s)), z_label
    e = torch.exp(d, out=ws.get(1, rows, cols))
    s = e.sum(dim=1)
    t = row_dot_(d, e)
    return RowStats(m, s, t), z_label


def backward_tile(
    x: torch.Tensor,
    label_col: torch.Tensor,
    in_block: torch.Tensor,
    k: float | torch.Tensor,
    scaling: Scaling,
    ws: Workspace,
    neg_m: torch.Tensor,
    coef_a: torch.Tensor,
    coef_b: torch.Tensor | None,
    label_term: torch.Tensor,
) -> torch.Tensor:
    """``dz`` of one tile, in the input dtype, ready for the two gradient GEMMs (may reuse ``x``).

    With ``d = z - m`` and ``e = exp(d)``: ``dz = e * (a + b * d) [* (1 - tanh^2)] + onehot *
    label_term``, where the per-row ``a``, ``b`` and ``label_term`` fold in the upstream gradients,
    ``1 / T`` and the softmax normaliser (see ``chunked._coefficients``).
    """
    rows, cols = x.shape
    col = label_col.unsqueeze(1)
    low = x.dtype != FP32
    capped = scaling.softcap is not None
    if capped:
        src = scaling.source(x, out=ws.get(0, rows, cols) if low else x)
        d_out, e_out = ws.get(1, rows, cols), ws.get(2, rows, cols)
    else:
        src = x
        d_out, e_out = (ws.get(0, rows, cols) if low else x), ws.get(1, rows, cols)
    d = affine(src, k, neg_m, out=d_out)
    e = torch.exp(d, out=e_out)
    e_label = e.gather(1, col).squeeze(1)
    if coef_b is not None:
        u: torch.Tensor = torch.addcmul(coef_a.unsqueeze(1), d, coef_b.unsqueeze(1), out=d)
        u_label = u.gather(1, col).squeeze(1)
    else:
        u, u_label = coef_a.unsqueeze(1), coef_a
    dz_label = torch.addcmul(label_term, e_label, u_label)
    dz_out = x if low else e
    if capped:
        t_label = src.gather(1, col).squeeze(1)
        dz_label = dz_label - dz_label * t_label * t_label
        e.mul_(u)
        dz = torch.addcmul(e, e, src.square_(), value=-1.0, out=dz_out)
    else:
        dz = torch.mul(e, u, out=dz_out)
    current = dz.gather(1, col).squeeze(1)
    patched = torch.where(in_block, dz_label.to(dz.dtype), current)
    return dz.scatter_(1, col, patched.unsqueeze(1))
