"""The policy loss's weight gradient over row chunks (``launch.dw_chunk``): the dh kernels read
each chunk's ``dz`` transposed and add ``dz^T h`` into a split running sum whose high half is the
returned gradient's own buffer, rounded once by the last chunk. Exact fp32 low halves
(``memory="fast"``, fp16, more than one chunk), fp24 (a bf16 weight under ``memory="low"``), no
split for fp32 or one chunk.

CPU interpreter, fp16 and fp32 (bf16 dots are wrong under the interpreter; the bf16 choice of
format is checked on meta tensors, its values on the GPU).
"""

from __future__ import annotations

import pytest
import torch
from triton_backend_helpers import SUM_UNIT, assert_within_one_ulp, sum_slack

from fusedhead_triton import sum_format
from fusedhead_triton.configs import Settings, TileConfig, settings_for
from fusedhead_triton.launch import dw_chunk
from fusedhead_triton.policy import _weight_grad_sum

#: Small tiles (V = 72 is 3 row tiles with a ragged last one, rows of 144 bytes as TMA takes them; H = 48, one and a half column tiles).
TILE = TileConfig(32, 32, 16, group_m=2, num_warps=4, num_stages=2)
PATHS = ["pointer", "tma"]


def _chunks(n_chunks: int, rows: int, v: int, h: int, dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(rows, v, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype))
        for _ in range(n_chunks)
    ]


def _summed(parts: list, fmt: str | None, path: str) -> torch.Tensor:
    v, h, dtype = parts[0][0].shape[1], parts[0][1].shape[1], parts[0][0].dtype
    acc = sum_format.allocate(v, h, dtype, torch.device("cpu"), False, fmt)
    cfg = TileConfig(**{**TILE.__dict__, "tma": path == "tma"})
    for i, (dz, hr) in enumerate(parts):
        dw_chunk(dz, hr, acc, cfg, first=i == 0, last=i == len(parts) - 1)
    return acc.out


def _exact(parts: list) -> torch.Tensor:
    return sum(dz.double().t() @ hr.double() for dz, hr in parts)  # type: ignore[return-value]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["fp32", "fp24"])
def test_a_16_bit_weight_gradient_is_within_one_ulp_of_the_exact_sum(fmt: str, path: str) -> None:
    parts = _chunks(9, 20, 72, 48, torch.float16)
    want = _exact(parts)
    got = _summed(parts, fmt, path)
    assert got.dtype == torch.float16 and got.shape == (72, 48)
    slack = sum_slack(want, len(parts), SUM_UNIT[fmt])
    assert_within_one_ulp(got, want.to(torch.float16), slack=slack, what=f"{fmt} {path}")
    # the bound tells sums apart: a 16-bit running sum, rounded once a chunk, leaves it
    running = torch.zeros(72, 48, dtype=torch.float16)
    for dz, hr in parts:
        running = (running.double() + dz.double().t() @ hr.double()).to(torch.float16)
    with pytest.raises(AssertionError):
        assert_within_one_ulp(running, want.to(torch.float16), slack=slack)


@pytest.mark.parametrize("path", PATHS)
def test_one_chunk_and_fp32_write_the_sum_itself(path: str) -> None:
    one = _chunks(1, 24, 72, 48, torch.float16)
    assert_within_one_ulp(_summed(one, None, path), _exact(one).to(torch.float16))
    parts = _chunks(4, 12, 72, 48, torch.float32)
    got = _summed(parts, None, "pointer")
    want = _exact(parts)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def _format(dtype: torch.dtype, memory: str, chunks: int) -> tuple[int, int]:
    """(SUM_LO, low part's bytes a value) of the policy loss's weight-gradient sum."""
    weight = torch.empty(151936, 4096, dtype=dtype, device="meta")
    st: Settings = settings_for(dtype, memory=memory)  # type: ignore[arg-type]
    acc = _weight_grad_sum(weight, chunks, st)
    assert acc.out.shape == weight.shape and acc.out.dtype == dtype
    return acc.sum_lo, (0 if acc.lo is acc.out else acc.lo.element_size())


def test_the_low_part_is_a_byte_only_beside_a_bf16_weight_under_low_memory() -> None:
    assert _format(torch.bfloat16, "low", 3) == (8, 1)  # fp24: 8 bits below bf16's rounding
    assert _format(torch.bfloat16, "fast", 3) == (16, 2)
    assert _format(torch.float16, "low", 3) == (16, 2)  # fp24 is 5 bits below fp16's
    assert _format(torch.bfloat16, "low", 1) == (0, 0)  # one chunk writes the result itself
    assert _format(torch.float32, "low", 3) == (0, 0)
