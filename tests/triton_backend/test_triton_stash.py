"""``stash_dh_sum``: the hidden-gradient sum borrows dW's last rows, which are written afterwards
from recomputed logits. The same values as without it up to the sum's order (the stashed rows'
blocks add first) and format (fp24 by default), less memory, and a clean fallback where dW
cannot hold the sum."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from head_cases import case_loss
from triton_backend_helpers import (
    IGNORE,
    SMALL_TILES,
    SUM_UNIT,
    Case,
    Result,
    assert_close,
    assert_within_one_ulp,
    make_case,
    run_reference,
    run_triton,
    sum_slack,
)

from fusedhead.protocol import call_backend
from fusedhead_triton import TritonBackend, TritonOptions, launch
from fusedhead_triton import backend as backend_mod
from fusedhead_triton.configs import BackendConfigs

#: Vb = one 64-column tile: 6 vocabulary blocks at V = 333, so the sum spans several blocks;
#: every dz block in the buffer (lend_dw_rows has its own tests: test_triton_dh_sum.py).
MANY_BLOCKS: dict[str, Any] = {
    **SMALL_TILES,
    "backward_block_mib": 1e-4,
    "lend_dw_rows": False,
}


def _spy_take(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Record (dtype, first lent row) of every loan of dW's rows."""
    taken: list[tuple[torch.dtype, int]] = []
    real = launch.SpareRows.take

    def take(self: launch.SpareRows, kind: torch.dtype) -> torch.Tensor:
        taken.append((kind, self.first))
        return real(self, kind)

    monkeypatch.setattr(launch.SpareRows, "take", take)
    return taken


#: Upper bound on the blocks that add to dh at V = 333 (6 of 64 columns, one more when stashed).
ADDS = 7


@pytest.mark.parametrize(
    ("dh_sum", "loan", "first", "unit"),
    [
        # fp24 (the default with a stash): 40 x 64 x 1 bytes = 20 rows of 128 bytes
        ("auto", torch.int8, 333 - 20, SUM_UNIT["fp24"]),
        # fp16's "pair" is a plain fp32 buffer: 40 x 64 x 4 bytes = 80 rows
        ("pair", torch.float32, 333 - 80, SUM_UNIT["fp32"]),
        # exact fp32 halves: the high one in dh's own buffer, the low one 2 bytes = 40 rows
        ("fp32", torch.int16, 333 - 40, SUM_UNIT["fp32"]),
    ],
    ids=["auto-fp24", "pair", "fp32"],
)
@pytest.mark.parametrize("tma", ["pointer", "tma", "tma-sum"])
def test_stashed_sum_gives_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
    tma: str,
    dh_sum: str,
    loan: torch.dtype,
    first: int,
    unit: float,
) -> None:
    case = make_case(40, 64, 333, seed=21)
    opts = {**MANY_BLOCKS, "tma": tma != "pointer"}
    if tma == "tma-sum":  # the sum read and written through TMA descriptors over dW's rows
        pick = backend_mod.default_configs

        def with_tma_sum(dtype: torch.dtype) -> BackendConfigs:
            base = pick(dtype)
            return replace(base, dh=replace(base.dh, tma_sum=True))

        monkeypatch.setattr(backend_mod, "default_configs", with_tma_sum)
    # not stashed, an exact fp32 sum
    plain = run_triton(
        case, torch.float16, options={**opts, "stash_dh_sum": False, "dh_sum": "fp32"}
    )
    taken = _spy_take(monkeypatch)
    stashed = run_triton(
        case, torch.float16, options={**opts, "stash_dh_sum": True, "dh_sum": dh_sum}
    )
    assert taken == [(loan, first)]
    assert torch.equal(stashed.log_probs, plain.log_probs)
    assert torch.equal(stashed.entropy, plain.entropy)
    # the same blocks, the stashed rows' first: within one ulp but for the sum's own rounding
    slack = sum_slack(plain.d_hidden, ADDS, unit)
    assert_within_one_ulp(stashed.d_hidden, plain.d_hidden, slack=slack)
    assert torch.equal(stashed.d_weight[:first], plain.d_weight[:first])
    assert_close(stashed, run_reference(case, torch.float16), torch.float16)


@pytest.mark.parametrize("lend", [False, True], ids=["buffer", "lent-rows"])
def test_stashed_exact_halves_give_the_stashed_fp32_buffers_bits(
    monkeypatch: pytest.MonkeyPatch, lend: bool
) -> None:
    """Both stashed: the fp32 sum kept as two int16 halves (the low one in dW's rows) is as exact
    as a plain fp32 buffer in dW's rows. The stashes differ in size, so the block orders differ:
    within one fp16 ulp plus fp32 rounding (a lost low half would be 2^-8 off)."""
    case = make_case(40, 64, 333, seed=27)
    opts = {**MANY_BLOCKS, "tma": True, "stash_dh_sum": True, "lend_dw_rows": lend}
    taken = _spy_take(monkeypatch)
    buffer = run_triton(case, torch.float16, options={**opts, "dh_sum": "pair"})
    halves = run_triton(case, torch.float16, options={**opts, "dh_sum": "fp32"})
    assert [kind for kind, _ in taken] == [torch.float32, torch.int16]
    slack = sum_slack(buffer.d_hidden, ADDS, SUM_UNIT["fp32"])
    assert_within_one_ulp(halves.d_hidden, buffer.d_hidden, slack=slack)
    assert torch.equal(halves.log_probs, buffer.log_probs)
    assert_close(halves, run_reference(case, torch.float16), torch.float16)


def test_stash_with_a_ragged_tail_and_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 50 x 2 bytes: the lent tail starts on a 16-byte boundary, not where it would fit."""
    case = make_case(30, 50, 333, seed=22, peak=3.0)
    taken = _spy_take(monkeypatch)
    got = run_triton(
        case, torch.float16, softcap=2.0, options={**MANY_BLOCKS, "stash_dh_sum": True}
    )
    # the fp24 sum's low bytes: 30 x 50 x 1 fit in 15 rows (from 318), 16-byte aligned from 316
    fits = 333 - math.ceil(30 * 50 * 1 / 100)  # 318: the first row where 30 x 50 bytes fit
    first = max(r for r in range(fits + 1) if (r * 50 * 2) % 16 == 0)
    assert first == 316 and taken == [(torch.int8, first)]
    assert_close(got, run_reference(case, torch.float16, softcap=2.0), torch.float16)


@pytest.mark.parametrize(
    ("n", "v", "dh_sum", "loans"),
    [
        # even fp24's 1 byte a value does not fit: 200 x 48 x 1 > 96 x 48 x 2 bytes
        (200, 96, "auto", []),
        # fp24 fits (200 x 48 x 1 <= 333 x 48 x 2 bytes, in the last 100 rows), fp32 doesn't
        (200, 333, "auto", [(torch.int8, 233)]),
        (200, 333, "pair", []),  # fp16's fp32 sum: 200 x 48 x 4 > 333 x 48 x 2 bytes
    ],
    ids=["fp24-too-big", "fp24-fits", "fp32-too-big"],
)
def test_no_stash_where_dw_is_smaller_than_the_sum(
    monkeypatch: pytest.MonkeyPatch, n: int, v: int, dh_sum: str, loans: list
) -> None:
    case = make_case(n, 48, v, seed=23)
    taken = _spy_take(monkeypatch)
    got = run_triton(
        case, torch.float16, options={**MANY_BLOCKS, "stash_dh_sum": True, "dh_sum": dh_sum}
    )
    assert taken == loans
    assert_close(got, run_reference(case, torch.float16), torch.float16)


@pytest.mark.parametrize(
    ("grad_hidden", "grad_weight"), [(True, False), (False, True)], ids=["dh-only", "dw-only"]
)
def test_no_stash_without_both_gradients(
    monkeypatch: pytest.MonkeyPatch, grad_hidden: bool, grad_weight: bool
) -> None:
    case = make_case(40, 48, 333, seed=24)
    taken = _spy_take(monkeypatch)
    got = run_triton(
        case, torch.float16, grad_hidden=grad_hidden, grad_weight=grad_weight,
        options={**MANY_BLOCKS, "stash_dh_sum": True},
    )  # fmt: skip
    assert taken == []
    assert (got.d_hidden is not None) == grad_hidden and (got.d_weight is not None) == grad_weight
    assert_close(got, run_reference(case, torch.float16), torch.float16)


def test_no_stash_for_fp32_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 sums straight into the fp32 output: there is no separate sum to move."""
    case = make_case(40, 48, 333, seed=25)
    taken = _spy_take(monkeypatch)
    got = run_triton(case, torch.float32, options={**MANY_BLOCKS, "stash_dh_sum": True})
    assert taken == []
    assert_close(got, run_reference(case, torch.float32), torch.float32)


def _run_with_peak(case: Case, options: dict[str, Any]) -> tuple[Result, int]:
    """bf16 forward + backward on the GPU, and the peak memory it takes beyond its inputs (made
    first: converting the float64 case would otherwise set the peak)."""
    h = case.hidden.to(torch.bfloat16).cuda().requires_grad_()
    w = case.weight.to(torch.bfloat16).cuda().requires_grad_()
    lab = case.labels.cuda()
    be = TritonBackend(TritonOptions(**options))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = call_backend(be,
        h, w, lab, temperature=0.7, ignore_index=IGNORE, return_entropy=True, process_group=None,
        vocab_start=0, vocab_size=w.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip
    case_loss(lp, ent, case).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert ent is not None and h.grad is not None and w.grad is not None
    return Result(lp.detach(), ent.detach(), h.grad, w.grad), peak


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dh_gemm", "dh_sum", "per_value", "unit"),
    [
        ("triton", "pair", 2, SUM_UNIT["bf16 pair"]),  # the pair's bf16 low half
        ("triton", "fp24", 1, SUM_UNIT["fp24"]),  # fp24's low byte
        ("cublas", "auto", 4, SUM_UNIT["fp32"]),  # cuBLAS's fp32 accumulator, whatever dh_sum
    ],
    ids=["triton-pair", "triton-fp24", "cublas"],
)
def test_stash_on_the_gpu_saves_the_sum_and_keeps_the_values(
    monkeypatch: pytest.MonkeyPatch, dh_gemm: str, dh_sum: str, per_value: int, unit: float
) -> None:
    """bf16: the sum's own buffer (N x H x bytes a value) leaves for dW's last rows."""
    if dh_gemm == "cublas" and not launch.cublas_fp32_out_available(torch.device("cuda")):
        pytest.skip("this torch has no addmm(out_dtype=float32) on CUDA")
    n, h, v = 1000, 512, 20000
    case = make_case(n, h, v, seed=26)
    # several vocabulary blocks: 2 MiB / (1000 x 2 bytes) -> 1024 columns, 20 blocks
    opts = {"backward_block_mib": 2, "dh_gemm": dh_gemm, "dh_sum": dh_sum, "lend_dw_rows": False}
    sum_bytes = n * h * per_value
    peaks = {}
    results = {}
    for stash in (False, True):
        results[stash], peaks[stash] = _run_with_peak(case, {**opts, "stash_dh_sum": stash})
    assert peaks[True] <= peaks[False] - sum_bytes * 0.9, peaks
    plain, stashed = results[False], results[True]
    # the stashed rows' blocks add first: not the same order, so not the same bits
    slack = sum_slack(plain.d_hidden, 21, unit)
    assert_within_one_ulp(stashed.d_hidden, plain.d_hidden, slack=slack)
    ref = run_reference(case, torch.bfloat16)
    from triton_backend_helpers import rel_err

    assert rel_err(stashed.d_weight.cpu(), ref.d_weight) < 5e-3
    assert rel_err(stashed.d_hidden.cpu(), ref.d_hidden) < 5e-3
    first = v - -(-sum_bytes // (h * 2))
    # rows of the blocks wholly before the stash: the same dz, the same GEMM, the same bits (the
    # block the stash cuts short is a GEMM of other shape: cuBLAS may pick another kernel)
    whole = first // 1024 * 1024
    assert torch.equal(stashed.d_weight[:whole], plain.d_weight[:whole])
    again = run_triton(case, torch.bfloat16, device="cuda", options={**opts, "stash_dh_sum": True})
    assert torch.equal(again.d_weight, stashed.d_weight)  # deterministic, the tail included
    assert torch.equal(again.d_hidden, stashed.d_hidden)
