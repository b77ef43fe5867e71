"""The hidden-gradient running sum's bits between vocabulary blocks (``SUM_LO`` of the dh kernels).

The fp32 sum is split: its high 16 bits live in the output's own buffer (as int16), the rest in a
separate low part. ``SUM_LO`` 16 keeps the low 16 bits (exact fp32); 8 keeps bits 8-15, rounded
(fp24: a 16-bit significand, one byte a value). 0 means no split: one fp32 buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_join(hi, lo, SUM_LO: tl.constexpr):
    """The running sum's fp32 value from its two stored parts."""
    bits = hi.to(tl.int32) << 16  # sign-extended int16: the shift leaves exactly its 16 bits
    if SUM_LO == 16:  # noqa: SIM108 - constexpr branch
        bits = bits | (lo.to(tl.int32) & 0xFFFF)
    else:
        bits = bits | ((lo.to(tl.int32) & 0xFF) << 8)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def sum_split(total, SUM_LO: tl.constexpr):
    """(hi, lo) to store for the fp32 running sum ``total`` (the inverse of ``sum_join``)."""
    bits = total.to(tl.int32, bitcast=True)
    if SUM_LO == 8:
        # round the magnitude to 24 bits (sign-magnitude format); a NaN stays one (quiet bit
        # set: its payload may lie in the dropped bits)
        bits = tl.where(total != total, bits | 0x400000, bits + 0x80)
        lo = (bits >> 8).to(tl.int8)  # integer narrowing keeps the low bits
    else:
        lo = bits.to(tl.int16)
    return (bits >> 16).to(tl.int16), lo


@triton.jit
def sum_update(
    part, offs_m, offs_n, N, H, hi_ptr, lo_ptr, out_ptr,
    FIRST: tl.constexpr, LAST: tl.constexpr, SUM_LO: tl.constexpr,
):  # fmt: skip
    """Add a block's fp32 tile to the running sum, or write the result on the last block."""
    mask = (offs_m < N)[:, None] & (offs_n < H)[None, :]
    idx = offs_m.to(tl.int64)[:, None] * H + offs_n[None, :]
    total = part
    if not FIRST:
        if SUM_LO == 0:
            total += tl.load(hi_ptr + idx, mask=mask, other=0.0)
        else:
            hi = tl.load(hi_ptr + idx, mask=mask, other=0)
            total += sum_join(hi, tl.load(lo_ptr + idx, mask=mask, other=0), SUM_LO)
    if LAST:
        tl.store(out_ptr + idx, total.to(out_ptr.dtype.element_ty), mask=mask)
    elif SUM_LO == 0:
        tl.store(hi_ptr + idx, total, mask=mask)
    else:
        hi, lo = sum_split(total, SUM_LO)
        tl.store(hi_ptr + idx, hi, mask=mask)
        tl.store(lo_ptr + idx, lo, mask=mask)
