"""The policy loss's row chunks: as few as the kept buffer's budget allows, of equal size in whole
128-row tiles (no small last chunk with a GEMM and a weight-gradient read-modify-write of its own)."""

from __future__ import annotations

import math

import pytest
import torch

from fusedhead_triton.policy import chunk_rows

V = 151936
GIB = 2**30


@pytest.mark.parametrize("n", [1, 100, 3456, 3457, 7430, 8192, 29538, 32768, 100_000])
@pytest.mark.parametrize("budget", [GIB // 4, GIB, 2 * GIB])
def test_chunks_are_few_equal_whole_tiles_within_the_budget(n: int, budget: int) -> None:
    rows = chunk_rows(n, V, torch.bfloat16, budget, None)
    most = budget // (V * 2) // 128 * 128  # the buffer's rows (fp16 offsets: 2 bytes a value)
    chunks = math.ceil(n / rows)
    assert chunks == math.ceil(n / most)  # no more chunks than the budget forces
    if rows < n:
        assert rows % 128 == 0 and rows <= most
        assert n - (chunks - 1) * rows > rows - 128 * chunks  # the last chunk is nearly full
    else:
        assert rows == n


def test_an_explicit_chunk_is_taken_as_given() -> None:
    assert chunk_rows(7430, V, torch.bfloat16, GIB, 768) == 768


def test_fp32_inputs_keep_four_bytes_a_value() -> None:
    assert chunk_rows(100_000, V, torch.float32, GIB, None) <= GIB // (V * 4)


def test_a_softcap_keeps_the_raw_logits_four_bytes_a_value() -> None:
    """The raw fp32 logits beside 16-bit inputs (the cap's derivative is taken from them)."""
    rows = chunk_rows(100_000, V, torch.bfloat16, GIB, None, softcap=True)
    assert rows <= GIB // (V * 4) < chunk_rows(100_000, V, torch.bfloat16, GIB, None)


W16 = torch.empty(V, 4096, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("budget", [GIB, 2 * GIB])
def test_rows_that_fit_the_fp32_sums_bytes_go_in_one_chunk(budget: int) -> None:
    """With a bf16 weight gradient asked, the rows whose kept buffer fits the budget plus the
    gradient's size (what the fp32 sum and its rounded copy would take beyond the budget) go in
    one chunk, whose GEMM rounds the gradient itself; more rows are chunked as before."""
    from fusedhead_triton.policy import kept_budget, one_chunk_budget

    kept = kept_budget(budget, W16, need_weight_grad=True)
    one = one_chunk_budget(kept, W16, need_weight_grad=True)
    assert one == kept + V * 4096 * 2
    fit = one // (V * 2)
    assert chunk_rows(fit, V, torch.bfloat16, kept, None, one_chunk_bytes=one) == fit
    assert (
        chunk_rows(fit + 1, V, torch.bfloat16, kept, None, one_chunk_bytes=one)
        == chunk_rows(fit + 1, V, torch.bfloat16, kept, None)
        < fit + 1
    )
    # the one chunk's peak (its buffer and the bf16 gradient) is within the chunks' (the fp32
    # sum and the larger of the buffer and the rounded copy)
    assert fit * V * 2 + V * 4096 * 2 <= 2 * V * 4096 * 2 + max(kept, V * 4096 * 2)


@pytest.mark.parametrize(
    ("dtype", "need"), [(torch.float16, True), (torch.float32, True), (torch.bfloat16, False)]
)
def test_no_one_chunk_budget_where_no_bf16_sum_would_be_rounded(
    dtype: torch.dtype, need: bool
) -> None:
    """fp16 keeps its fp32 sum as the result, fp32 has no sum to save, and without the weight
    gradient there is no sum at all: none of them gets the larger one-chunk bound."""
    from fusedhead_triton.policy import one_chunk_budget

    w = torch.empty(V, 4096, dtype=dtype, device="meta")
    assert one_chunk_budget(GIB, w, need_weight_grad=need) == 0
