"""``stash_dh_sum``: the hidden-gradient sum borrows dW's last rows, which are written afterwards
from recomputed logits. Same values as without it, less memory, and a clean fallback where dW
cannot hold the sum."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from triton_backend_helpers import SMALL_TILES, assert_close, make_case, run_reference, run_triton

from fusedhead_triton import backend as backend_mod
from fusedhead_triton import launch
from fusedhead_triton.configs import BackendConfigs

#: Vb = one 64-column tile: 6 vocabulary blocks at V = 333, so the sum spans several blocks.
MANY_BLOCKS: dict[str, Any] = {**SMALL_TILES, "backward_block_mib": 1e-4}


def _spy_take(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Record (dtype, first lent row) of every loan of dW's rows."""
    taken: list[tuple[torch.dtype, int]] = []
    real = launch.SpareRows.take

    def take(self: launch.SpareRows, kind: torch.dtype) -> torch.Tensor:
        taken.append((kind, self.first))
        return real(self, kind)

    monkeypatch.setattr(launch.SpareRows, "take", take)
    return taken


@pytest.mark.parametrize("tma", ["pointer", "tma", "tma-sum"])
def test_stashed_sum_gives_the_same_gradients(monkeypatch: pytest.MonkeyPatch, tma: str) -> None:
    case = make_case(40, 64, 333, seed=21)
    opts = {**MANY_BLOCKS, "tma": tma != "pointer"}
    if tma == "tma-sum":  # the sum read and written through TMA descriptors over dW's rows
        pick = backend_mod.default_configs

        def with_tma_sum(dtype: torch.dtype) -> BackendConfigs:
            base = pick(dtype)
            return replace(base, dh=replace(base.dh, tma_sum=True))

        monkeypatch.setattr(backend_mod, "default_configs", with_tma_sum)
    plain = run_triton(case, torch.float16, options=opts)
    taken = _spy_take(monkeypatch)
    stashed = run_triton(case, torch.float16, options={**opts, "stash_dh_sum": True})
    # fp16 sums in fp32: 40 x 64 x 4 bytes = 80 rows of 128 bytes at the end of dW
    assert taken == [(torch.float32, 333 - 80)]
    first = taken[0][1]
    assert torch.equal(stashed.log_probs, plain.log_probs)
    assert torch.equal(stashed.entropy, plain.entropy)
    assert torch.equal(stashed.d_hidden, plain.d_hidden)  # same blocks, same order, same sum
    assert torch.equal(stashed.d_weight[:first], plain.d_weight[:first])
    assert_close(stashed, run_reference(case, torch.float16), torch.float16)


def test_stash_with_a_ragged_tail_and_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 50 x 2 bytes: the lent tail starts on a 16-byte boundary, not where it would fit."""
    case = make_case(30, 50, 333, seed=22, peak=3.0)
    taken = _spy_take(monkeypatch)
    got = run_triton(
        case, torch.float16, softcap=2.0, options={**MANY_BLOCKS, "stash_dh_sum": True}
    )
    assert len(taken) == 1
    first = taken[0][1]
    assert (first * 50 * 2) % 16 == 0 and (333 - first) * 100 >= 30 * 50 * 4
    assert_close(got, run_reference(case, torch.float16, softcap=2.0), torch.float16)


def test_no_stash_where_dw_is_smaller_than_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(200, 48, 333, seed=23)  # the fp32 sum needs 200 x 48 x 4 > 333 x 48 x 2 bytes
    taken = _spy_take(monkeypatch)
    got = run_triton(case, torch.float16, options={**MANY_BLOCKS, "stash_dh_sum": True})
    assert taken == []
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


def _peak_extra(fn: Any) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@pytest.mark.parametrize("dh_gemm", ["triton", "cublas"])
def test_stash_on_the_gpu_saves_the_sum_and_keeps_the_values(
    monkeypatch: pytest.MonkeyPatch, dh_gemm: str
) -> None:
    """bf16: the pair's low half (N x H x 2) or cuBLAS's fp32 accumulator (N x H x 4) leaves."""
    if dh_gemm == "cublas" and not launch.cublas_fp32_out_available(torch.device("cuda")):
        pytest.skip("this torch has no addmm(out_dtype=float32) on CUDA")
    n, h, v = 1000, 512, 20000
    case = make_case(n, h, v, seed=26)
    opts = {"backward_block_mib": 2, "dh_gemm": dh_gemm}  # several vocabulary blocks
    sum_bytes = n * h * (2 if dh_gemm == "triton" else 4)
    peaks = {}
    results = {}
    for stash in (False, True):
        o = {**opts, "stash_dh_sum": stash}

        def go(stash: bool = stash, o: dict = o) -> None:
            results[stash] = run_triton(case, torch.bfloat16, device="cuda", options=o)

        peaks[stash] = _peak_extra(go)
    assert peaks[True] <= peaks[False] - sum_bytes * 0.9, peaks
    plain, stashed = results[False], results[True]
    assert torch.equal(stashed.d_hidden, plain.d_hidden)
    ref = run_reference(case, torch.bfloat16)
    from triton_backend_helpers import rel_err

    assert rel_err(stashed.d_weight.cpu(), ref.d_weight) < 5e-3
    assert rel_err(stashed.d_hidden.cpu(), ref.d_hidden) < 5e-3
    first = v - -(-sum_bytes // (h * 2))
    assert torch.equal(stashed.d_weight[:first], plain.d_weight[:first])
    again = run_triton(case, torch.bfloat16, device="cuda", options={**opts, "stash_dh_sum": True})
    assert torch.equal(again.d_weight, stashed.d_weight)  # deterministic, the tail included
    assert torch.equal(again.d_hidden, stashed.d_hidden)
