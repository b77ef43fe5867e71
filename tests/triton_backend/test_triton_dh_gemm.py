"""``dh_gemm``: which GEMM sums the hidden gradient over vocabulary blocks. "auto" takes the Triton
kernel (its sum split in two parts) for bf16, and for fp16 cuBLAS (fp32 accumulator) only while
that accumulator is small."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_backend_helpers import make_case, rel_err, run_reference, run_triton

from fusedhead_triton import launch


def _count_addmm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = torch.addmm

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(launch.torch, "addmm", spy)
    return calls


def test_auto_uses_triton_where_cublas_has_no_fp32_output(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_addmm(monkeypatch)
    case = make_case(20, 32, 300)
    got = run_triton(case, torch.float16, options={"backward_block_max_cols": 64})
    assert calls[0] == 0
    ref = run_reference(case, torch.float16)
    assert rel_err(got.d_hidden, ref.d_hidden) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("limit", [2**40, 0], ids=["small-accumulator", "over-the-limit"])
def test_auto_picks_cublas_for_fp16_only_under_the_accumulator_limit(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    if not launch.cublas_fp32_out_available(torch.device("cuda")):
        pytest.skip("this torch has no addmm(out_dtype=float32) on CUDA")
    monkeypatch.setattr(launch, "AUTO_CUBLAS_ACC_BYTES", limit)
    calls = _count_addmm(monkeypatch)
    case = make_case(1000, 512, 20000)
    opts = {"backward_block_mib": 4}  # several vocabulary blocks
    auto = run_triton(case, torch.float16, device="cuda", options=opts)
    assert (calls[0] > 0) == (limit > 0)
    ref = run_reference(case, torch.float16)
    assert rel_err(auto.d_hidden.cpu(), ref.d_hidden) < 5e-3
    assert rel_err(auto.d_weight.cpu(), ref.d_weight) < 5e-3
    again = run_triton(case, torch.float16, device="cuda", options=opts)
    assert torch.equal(again.d_hidden, auto.d_hidden) and torch.equal(again.d_weight, auto.d_weight)


@pytest.mark.gpu
def test_auto_sums_bf16_in_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: the Triton kernel's split sum, never cuBLAS's fp32 accumulator, whatever N; both
    within bounds."""
    if not launch.cublas_fp32_out_available(torch.device("cuda")):
        pytest.skip("this torch has no addmm(out_dtype=float32) on CUDA")
    calls = _count_addmm(monkeypatch)
    case = make_case(1000, 512, 20000)
    opts = {"backward_block_mib": 4}
    auto = run_triton(case, torch.bfloat16, device="cuda", options=opts)
    assert calls[0] == 0
    cublas = run_triton(case, torch.bfloat16, device="cuda", options={**opts, "dh_gemm": "cublas"})
    assert calls[0] > 0
    ref = run_reference(case, torch.bfloat16)
    for got in (auto, cublas):
        assert rel_err(got.d_hidden.cpu(), ref.d_hidden) < 5e-3
        assert rel_err(got.d_weight.cpu(), ref.d_weight) < 5e-3
