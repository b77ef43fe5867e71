"""A policy loss's weight gradient is summed over its row chunks in fp32 and rounded once
(``fusedhead.grad_sum.WeightGradSum``, issue 31 item 4): a 16-bit weight's gradient is the
fp32 sum's rounding whatever the number of chunks, not a 16-bit running sum's drift."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from policy_backends import POLICY_BACKENDS

import fusedhead
from fusedhead.grad_sum import WeightGradSum

SMALL_CHUNK = {"torch": {"chunk_rows": 8}, "triton": {"policy_chunk_rows": 8}}
ONE_CHUNK = {"torch": {"chunk_rows": 256}, "triton": {"policy_chunk_rows": 256}}


def chunks(n_chunks: int, rows: int, v: int, h: int, dtype: torch.dtype, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, v, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype))
        for _ in range(n_chunks)
    ]


def exact(parts: list) -> torch.Tensor:
    """The sum in float64 (every product of 16-bit values is exact there, and so, at these
    sizes, is the sum)."""
    return sum(dz.double().t() @ h.double() for dz, h in parts)  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("v", [50, 3, 64], ids=["v50", "v3", "v64"])
def test_a_16_bit_weight_gradient_is_the_exact_sum_rounded_once(dtype: torch.dtype, v: int) -> None:
    parts = chunks(32, 8, v, 24, dtype)
    acc = WeightGradSum(torch.empty(v, 24, dtype=dtype))
    for dz, h in parts:
        acc.add(dz, h)
    got = acc.result()
    # fp16 hands over the fp32 sum, which the core rounds after the upstream scale
    assert got.dtype == (torch.float32 if dtype == torch.float16 else dtype)
    assert got.shape == (v, 24)
    got = got.to(dtype)
    want = exact(parts)
    # fp32 partial sums are ~2^16 finer than a 16-bit ulp: the rounding agrees but for values
    # within that of a tie; a 16-bit running sum rounds 32 times and misses many more.
    agree = (got == want.to(dtype)).float().mean().item()
    assert agree >= 0.99, agree
    running = torch.zeros(v, 24, dtype=dtype)
    for dz, h in parts:
        running = (running.float() + dz.float().t() @ h.float()).to(dtype)
    assert (running == want.to(dtype)).float().mean().item() < 0.9  # the test tells them apart


def test_an_fp32_weight_gradient_is_the_fp32_sum() -> None:
    parts = chunks(5, 8, 40, 16, torch.float32, seed=1)
    acc = WeightGradSum(torch.empty(40, 16))
    for dz, h in parts:
        acc.add(dz, h)
    want = torch.zeros(40, 16)
    for dz, h in parts:
        want.addmm_(dz.t(), h)
    got = acc.result()
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_no_chunk_gives_zeros_and_result_lets_go_of_the_sum() -> None:
    acc = WeightGradSum(torch.empty(10, 4, dtype=torch.bfloat16))
    assert torch.equal(acc.result(), torch.zeros(10, 4, dtype=torch.bfloat16))
    acc.add(torch.ones(2, 10, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16))
    assert torch.equal(acc.result(), torch.full((10, 4), 2.0, dtype=torch.bfloat16))
    assert acc._sum is None  # the fp32 sum is gone once rounded


def test_the_rounding_copy_is_a_16_bit_weight_gradient() -> None:
    """What ``result`` allocates beside the sum: the triton backend's kept buffer may be as large."""
    assert WeightGradSum.rounding_bytes(torch.empty(300, 8, dtype=torch.bfloat16)) == 4800
    assert WeightGradSum.rounding_bytes(torch.empty(300, 8)) == 0


#: fp16 on each backend (bf16 dots are wrong under the Triton interpreter), bf16 on torch: its
#: one chunk is the bf16 GEMM's own rounding (``WeightGradSum.add(only=True)``).
DRIFT_CASES = [(b, torch.float16) for b in POLICY_BACKENDS] + [("torch", torch.bfloat16)]


@pytest.mark.parametrize(("backend", "dtype"), DRIFT_CASES)
def test_a_policy_loss_weight_gradient_does_not_drift_with_the_chunks(
    backend: str, dtype: torch.dtype
) -> None:
    """256 rows as one chunk and as 32 chunks of 8 give the same rounding but for near-ties."""
    g = torch.Generator().manual_seed(7)
    n, h, v = 256, 32, 300
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / 3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    kw: dict[str, Any] = {
        "old_log_probs": torch.randn(n, generator=g) - 5,
        "advantages": torch.randn(n, generator=g),
        "entropy_coef": 0.01,
        "backend": backend,
    }

    def grad(options: dict[str, Any]) -> torch.Tensor:
        w = weight.clone().requires_grad_()
        fusedhead.fused_policy_loss(hidden, w, labels, options=options, **kw).loss.backward()
        assert w.grad is not None and w.grad.dtype == dtype
        return w.grad

    one, many = grad(ONE_CHUNK[backend]), grad(SMALL_CHUNK[backend])
    assert (one == many).float().mean().item() >= 0.99


def test_the_triton_kept_buffer_may_grow_to_the_rounding_copy() -> None:
    """The triton backend's kept buffer bound: its ``memory`` choice, or the 16-bit weight
    gradient's size where that is more and the gradient is asked (the peak is the rounding's)."""
    pytest.importorskip("triton")
    from fusedhead_triton.policy import kept_budget

    w16 = torch.empty(151936, 4096, dtype=torch.bfloat16, device="meta")
    assert kept_budget(1 << 30, w16, need_weight_grad=True) == 151936 * 4096 * 2
    assert kept_budget(2 << 30, w16, need_weight_grad=True) == 2 << 30
    assert kept_budget(1 << 30, w16, need_weight_grad=False) == 1 << 30
    w32 = torch.empty(151936, 4096, device="meta")
    assert kept_budget(1 << 30, w32, need_weight_grad=True) == 1 << 30


def test_one_bf16_chunk_is_its_gemm_rounded_once_with_no_fp32_sum() -> None:
    """``only=True``: the rows in one chunk; the bf16 GEMM accumulates in fp32 and rounds once,
    as the fp32 sum would, and no fp32 copy of the gradient is made."""
    ((dz, h),) = chunks(1, 64, 50, 24, torch.bfloat16, seed=3)
    acc = WeightGradSum(torch.empty(50, 24, dtype=torch.bfloat16))
    acc.add(dz, h, only=True)
    assert acc._sum is not None and acc._sum.dtype == torch.bfloat16  # never an fp32 sum
    got = acc.result()
    assert got.dtype == torch.bfloat16
    assert (got == exact([(dz, h)]).to(torch.bfloat16)).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_only_changes_nothing_where_the_sum_is_the_result(dtype: torch.dtype) -> None:
    """fp16 hands over its fp32 sum (the upstream scale comes first), fp32 is the sum: ``only``
    keeps them."""
    ((dz, h),) = chunks(1, 16, 30, 8, dtype, seed=4)
    plain, one = (
        WeightGradSum(torch.empty(30, 8, dtype=dtype)),
        WeightGradSum(torch.empty(30, 8, dtype=dtype)),
    )
    plain.add(dz, h, alpha=0.5)
    one.add(dz, h, alpha=0.5, only=True)
    a, b = plain.result(), one.result()
    assert a.dtype == b.dtype and torch.equal(a, b)


@contextlib.contextmanager
def reductions_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Every ``torch.mm``'s view of cuBLAS's bf16 reduced-precision reductions, with them allowed
    (the default) around the block, and the setting back as it was after it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    seen: list[bool] = []
    mm = torch.mm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(matmul.allow_bf16_reduced_precision_reduction)
        return mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", spy)
    matmul.allow_bf16_reduced_precision_reduction = True
    try:
        yield seen
        assert matmul.allow_bf16_reduced_precision_reduction is True  # put back
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
        monkeypatch.setattr(torch, "mm", mm)


def test_the_one_chunks_gemm_reduces_in_fp32_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS may add a split GEMM's parts in bf16 unless told not to: the one chunk's GEMM runs
    with that off (a rounding per part would undo the one rounding)."""
    acc = WeightGradSum(torch.empty(30, 8, dtype=torch.bfloat16))  # its trial GEMM first
    ((dz, h),) = chunks(1, 16, 30, 8, torch.bfloat16, seed=5)
    with reductions_seen(monkeypatch) as seen:
        acc.add(dz, h, only=True)
    assert seen == [False]


def test_the_hidden_gradients_bf16_gemm_reduces_in_fp32_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dX = dz W`` sums over the vocabulary (K = V), which cuBLAS splits for few rows: in bf16
    it runs with reduced-precision reductions off, as the weight gradient's one GEMM does."""
    from fusedhead.fp16_range import hidden_grad_rows

    dz, w = torch.randn(4, 30).bfloat16(), torch.randn(30, 8).bfloat16()
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    with reductions_seen(monkeypatch) as seen:
        hidden_grad_rows(dz, w, out, 1.0)
    assert seen == [False]
    assert torch.equal(out, torch.mm(dz, w))
