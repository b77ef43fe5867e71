"""Pipelining knobs of the persistent dh kernel change its schedule, never a value: every tile
still sums its K steps in the same order, so gradients are bitwise equal to the plain kernel's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from triton_backend_helpers import SMALL_TILES, make_case, run_triton

from fusedhead_triton import backend as backend_mod
from fusedhead_triton.configs import BackendConfigs, default_configs


def _with_dh(monkeypatch: pytest.MonkeyPatch, **knobs: bool | int) -> None:
    def pick(dtype: torch.dtype) -> BackendConfigs:
        base = default_configs(dtype)
        return replace(base, dh=replace(base.dh, **knobs))

    monkeypatch.setattr(backend_mod, "default_configs", pick)


@pytest.mark.parametrize(
    "knobs",
    [
        {"flatten": True},
        {"epilogue_splits": 2},
        {"flatten": True, "epilogue_splits": 2},
        {"prefetch_sum": True},
        {"prefetch_sum": True, "programs_per_sm": 2},
        {"epilogue_splits": 4},
        {"epilogue_splits": 1, "tma_sum": True},
        {"epilogue_splits": 2, "tma_sum": True},
        {"epilogue_splits": 4, "tma_sum": True},
    ],
    ids=[
        "flatten",
        "halves",
        "flatten-halves",
        "prefetch",
        "prefetch-2-per-sm",
        "quarters",
        "tma-sum",
        "tma-sum-halves",
        "tma-sum-quarters",
    ],
)
def test_dh_kernel_knobs_keep_the_bits(monkeypatch: pytest.MonkeyPatch, knobs: dict) -> None:
    case = make_case(70, 64, 333, seed=31)  # 3 row tiles, ragged H tiles, 6 vocabulary blocks
    opts = {**SMALL_TILES, "tma": True, "backward_block_mib": 1e-4, "dh_gemm": "triton"}
    plain = run_triton(case, torch.float16, options=opts)
    _with_dh(monkeypatch, **knobs)
    got = run_triton(case, torch.float16, options=opts)
    assert torch.equal(got.d_hidden, plain.d_hidden)
    assert torch.equal(got.d_weight, plain.d_weight)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tile", "knobs"),
    [
        ({}, {"flatten": True}),
        ({}, {"epilogue_splits": 2}),
        ({"block_n": 128}, {"prefetch_sum": True, "programs_per_sm": 2}),
        ({}, {"epilogue_splits": 4}),
        ({}, {"tma_sum": True}),
        ({}, {"tma_sum": True, "epilogue_splits": 4}),
    ],
    ids=["flatten", "halves", "128-prefetch-2-per-sm", "quarters", "tma-sum", "tma-sum-quarters"],
)
def test_dh_kernel_knobs_keep_the_bits_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch, tile: dict, knobs: dict
) -> None:
    case = make_case(1000, 512, 20000, seed=32)
    opts = {"backward_block_mib": 2, "dh_gemm": "triton"}  # the split sum over many blocks
    _with_dh(monkeypatch, **tile)
    plain = run_triton(case, torch.bfloat16, device="cuda", options=opts)
    _with_dh(monkeypatch, **tile, **knobs)
    got = run_triton(case, torch.bfloat16, device="cuda", options=opts)
    assert torch.equal(got.d_hidden, plain.d_hidden)
    assert torch.equal(got.d_weight, plain.d_weight)
