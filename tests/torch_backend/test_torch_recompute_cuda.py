"""On a CUDA GPU: the torch backend's backward builds its blocks from GEMMs of the forward's tiles,
each written in place into a column slice of the block (``aten::mm.dtype_out``), and at extreme
temperatures its gradients stay within the float64 bounds. Skipped with the reason without CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch_backend_helpers import (
    DTYPES,
    IGNORE,
    TOLERANCE,
    make_case,
    rel_err,
    run_backend,
    run_reference,
)

from fusedhead_torch import TorchOptions
from fusedhead_torch.tile_math import _MM_OUT_DTYPE_INTO, forward_logits, logits_mm
from fusedhead_torch.tiling import Tiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_gemm_written_into_a_column_slice_is_the_whole_gemms_bits(dtype: str) -> None:
    """The slice gets the GEMM's own bits, its neighbours keep theirs, and no copy was needed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(300, 512, generator=gen, device="cuda").to(DTYPES[dtype])
    b = torch.randn(512, 1024, generator=gen, device="cuda").to(DTYPES[dtype])
    block = torch.full((300, 3072), 7.0, device="cuda")
    got = logits_mm(a, b, True, out=block[:, 1024:2048])
    assert got.data_ptr() == block[:, 1024:2048].data_ptr()
    assert torch.equal(block[:, 1024:2048], logits_mm(a, b, True))
    assert bool((block[:, :1024] == 7.0).all()) and bool((block[:, 2048:] == 7.0).all())
    if dtype != "fp32":  # the fp32-output GEMM of 16-bit inputs went in place, not by a copy
        assert _MM_OUT_DTYPE_INTO.get(a.device, True)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "cols"), [((0, 700), (0, 3072)), ((256, 700), (1024, 5000))])
def test_a_backward_block_holds_the_forward_tiles_logits(
    dtype: str, rows: tuple[int, int], cols: tuple[int, int]
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(700, 256, generator=gen, device="cuda").to(DTYPES[dtype])
    w = torch.randn(5000, 256, generator=gen, device="cuda").to(DTYPES[dtype])
    grid = Tiles(256, 1024)
    want = torch.empty(700, 5000, device="cuda")
    for (r0, r1), (c0, c1) in itertools.product(grid.row_ranges(700), grid.col_ranges(5000)):
        want[r0:r1, c0:c1] = logits_mm(h[r0:r1], w[c0:c1].T, True)
    got = forward_logits(h, w, rows, cols, grid, fp32=True)
    assert torch.equal(got, want[rows[0] : rows[1], cols[0] : cols[1]])


@pytest.mark.parametrize("temperature", [1e-10, 1e-4, 0.7])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "options",
    [TorchOptions(), TorchOptions(workspace_mib=1), TorchOptions(chunk_rows=100, block_vocab=2048)],
    ids=["default", "small-workspace", "wide-blocks"],
)
def test_cuda_gradients_within_the_bounds_at_extreme_temperatures(
    temperature: float, dtype: str, options: TorchOptions
) -> None:
    case = make_case(300, 64, 6000)
    want = run_reference(case, dtype=DTYPES[dtype], temperature=temperature)
    got = run_backend(
        case, dtype=DTYPES[dtype], device="cuda", options=options, temperature=temperature
    )
    out_tol, grad_tol = TOLERANCE[dtype]
    kept = case.labels != IGNORE
    assert rel_err(got.log_probs.cpu()[kept], want.log_probs[kept]) <= out_tol
    assert rel_err(got.d_hidden.cpu(), want.d_hidden) <= grad_tol
    assert rel_err(got.d_weight.cpu(), want.d_weight) <= grad_tol
