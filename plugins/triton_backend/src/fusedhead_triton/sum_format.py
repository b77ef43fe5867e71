"""The hidden-gradient sum over vocabulary blocks: its format, and where its low part lives.

The sum is fp32 quality whatever the inputs. fp32 outputs (fp32 inputs, or a cross-rank sum
before rounding) are the sum themselves; so is a backward with one block. Otherwise the sum is
split (``kernels/sum_format.py``): its high 16 bits in the output's own buffer, its low part
either exact (``"fp32"``: 2 bytes a value, beside the output) or, when stashed in the weight
gradient's last rows until the sum is final, rounded to a 16-bit significand (``"fp24"``: 1 byte
a value, which halves the rows recomputed afterwards).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: ``SUM_LO`` of the dh kernels for each split format, and its low part's dtype.
SUM_LO = {"fp32": 16, "fp24": 8}
LOW_DTYPE = {"fp32": torch.int16, "fp24": torch.int8}


@dataclass(frozen=True)
class DhSum:
    """The dh result and the running sum's buffers, as the dh kernels take them."""

    out: torch.Tensor  #: the result (input dtype, or fp32)
    hi: torch.Tensor  #: the running sum, or its high half (``out``'s bits as int16)
    lo: torch.Tensor  #: the low part (``hi`` when not split)
    sum_lo: int  #: ``SUM_LO`` of the kernels (0: not split)
    stash_row: int | None  #: first dW row holding ``lo``, or None


def split_format(dtype: torch.dtype, adds: int, fp32_out: bool) -> bool:
    """Whether the sum needs a low part at all (16-bit output, more than one block adding)."""
    return not fp32_out and dtype != torch.float32 and adds > 1


def stash_row(dw: torch.Tensor, nbytes: int) -> int | None:
    """First row of the smallest 16-byte aligned tail of ``dw`` holding ``nbytes``, or None."""
    v, h = dw.shape
    row_bytes = h * dw.element_size()
    if row_bytes == 0 or dw.data_ptr() % 16:
        return None
    first = v - math.ceil(nbytes / row_bytes)
    while first > 0 and (first * row_bytes) % 16:
        first -= 1
    return first if first >= 0 and (first * row_bytes) % 16 == 0 else None


def rows_view(
    dw: torch.Tensor, first: int, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``shape`` of ``dtype`` over dW's bytes from row ``first`` on (the exact byte count: an
    odd number of bytes is no whole number of dW's 2-byte elements)."""
    start = first * dw.shape[1] * dw.element_size()
    nbytes = shape[0] * shape[1] * dtype.itemsize
    return dw.view(-1).view(torch.uint8)[start : start + nbytes].view(dtype).view(shape)


def allocate(
    n: int, h: int, dtype: torch.dtype, device: torch.device, fp32_out: bool, fmt: str | None,
    stash: int | None = None, dw: torch.Tensor | None = None,
) -> DhSum:  # fmt: skip
    """The output and the low part of format ``fmt`` (None: not split), in dW's rows from
    ``stash`` on when given."""
    out = torch.empty((n, h), dtype=torch.float32 if fp32_out else dtype, device=device)
    if fmt is None:
        return DhSum(out, out, out, 0, None)
    low = LOW_DTYPE[fmt]
    if stash is not None and dw is not None:
        lo = rows_view(dw, stash, (n, h), low)
    else:
        lo = torch.empty((n, h), dtype=low, device=device)
    return DhSum(out, out.view(torch.int16), lo, SUM_LO[fmt], stash)
