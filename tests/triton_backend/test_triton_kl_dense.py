"""The KL's backward: its hidden-gradient sum dense in fp32, and block widths of whole waves.

``backward.wave_columns`` picks block widths whose dz tiles fill whole waves of the persistent
programs where such a block fits the buffer's bound; ``_dense_backward`` adds each block's
``dz @ W[block]`` into one fp32 sum (cuBLAS on a GPU, upcast products on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedhead_triton.backward import Dense, _dense_backward, wave_columns
from fusedhead_triton.configs import MAX_COLS, settings_for
from fusedhead_triton.schedule import geometry, plan

H200 = Dense(block_m=128, block_n=128, programs=132)
MIB = 2**20


def test_whole_waves_at_the_bench_shape() -> None:
    """N = 8192 on 132 programs: 64 row tiles need column tiles in 33s (4224 columns), and the
    widest block is two of them, so a block's launch is 16 or 32 whole waves."""
    assert wave_columns(8192, H200, 2, 64 * MIB) == (4224, 8448)
    for cols in (4224, 8448):
        tiles = math.ceil(8192 / 128) * cols // 128
        assert tiles % 132 == 0


@pytest.mark.parametrize("n", [1, 77, 1000, 8192, 8193, 20000, 32768])
@pytest.mark.parametrize("programs", [4, 114, 132])
def test_wave_columns_fill_waves_or_stand_aside(n: int, programs: int) -> None:
    """Either every aligned block fills whole waves and its buffer stays within 10 % of the
    bound, or None (the plain alignment applies)."""
    d = Dense(128, 128, programs)
    got = wave_columns(n, d, 2, 64 * MIB)
    if got is None:
        return
    align, widest = got
    assert align % 128 == 0 and widest % align == 0 and widest <= 2 * MAX_COLS
    assert (math.ceil(n / 128) * (align // 128)) % programs == 0
    assert align * n * 2 <= 1.1 * 64 * MIB


def test_large_batches_keep_the_buffer_bound() -> None:
    """At N = 32768 a whole-wave block (4224 columns) would take a 264 MiB buffer: refused."""
    assert wave_columns(32768, H200, 2, 64 * MIB) is None


def test_the_schedule_with_wave_columns_covers_the_vocabulary_once() -> None:
    align, widest = wave_columns(8192, H200, 2, 64 * MIB) or (0, 0)
    g = geometry(8192, 4096, 151936, 2, align, 64 * MIB, widest)
    steps = plan(g, need_dw=True, need_dh=True, stash=None)
    assert sum(s.cols for s in steps) == 151936
    assert [s.v0 for s in steps] == sorted(s.v0 for s in steps)
    assert all(s.cols % align == 0 for s in steps[:-1])  # whole waves but for the last block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("need_dw", [True, False])
def test_dense_sum_is_the_fp32_sum_of_the_blocks(dtype: torch.dtype, need_dw: bool) -> None:
    """dh is the fp32 sum of the exact products (rounded once to the dtype), dW each block's
    ``dz.T @ hidden``, for a dz that ``fill_dz`` writes block by block."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 24, 700
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    full = torch.randn(n, v, generator=g).to(dtype)

    def fill_dz(v0: int, dz: torch.Tensor) -> None:
        dz.copy_(full[:, v0 : v0 + dz.shape[1]])

    st = settings_for(dtype, block_bytes=n * 128 * hidden.element_size())  # several blocks
    dh, dw = _dense_backward(hidden, weight, fill_dz, st, Dense(16, 128, 4), need_dw=need_dw,
                             dh_fp32=False)  # fmt: skip
    want = (full.double() @ weight.double()).to(dtype)
    assert dh.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(dh, want, rtol=tol, atol=tol * 10)
    if need_dw:
        assert dw is not None
        torch.testing.assert_close(dw.double(), (full.double().t() @ hidden.double()).to(dtype).double(),
                                   rtol=tol, atol=tol * 10)  # fmt: skip
    else:
        assert dw is None
