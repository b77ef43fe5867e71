"""The configured tiles' shared memory, estimated and checked against the device's limit.

A tile whose pipeline stages do not fit used to fail inside Triton's compile ("out of
resources") on the first call; the backend's check on a CUDA device now refuses it as an
``OptionsError`` naming the options, the estimate and the limit. Here on the CPU: the estimate
against what an H200 compiled (triton 3.6), and the check's wiring with a CUDA device simulated.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusedhead.errors import OptionsError
from fusedhead_triton import backend as backend_module
from fusedhead_triton.backend import TritonBackend, TritonOptions
from fusedhead_triton.configs import (
    SHARED_SLACK,
    settings_for,
    shared_memory_estimates,
    shared_memory_excess,
)

H200 = 232448  # 227 KiB: torch.cuda.get_device_properties(...).shared_memory_per_block_optin
A100 = 166912  # 163 KiB
RTX_3090 = 101376  # 99 KiB (sm_86)

#: What an H200 compiled (triton 3.6, ``metadata.shared``, bytes) by (dtype, options, kernel).
MEASURED: list[tuple[torch.dtype, dict[str, Any], str, int]] = [
    (torch.bfloat16, {}, "forward", 147480),
    (torch.bfloat16, {}, "dz", 213016),
    (torch.bfloat16, {}, "dh", 147480),
    (torch.bfloat16, {}, "kl forward", 131104),
    (torch.bfloat16, {}, "kl dz", 164864),
    (torch.bfloat16, {"tma": False}, "forward", 147456),
    (torch.bfloat16, {"tma": False}, "dz", 147456),
    (torch.bfloat16, {"tma": False}, "kl forward", 98304),
    (torch.float32, {}, "forward", 49152),
    (torch.float32, {}, "kl dz", 49152),
    (torch.float32, {"tma": True}, "forward", 65552),
    (torch.float32, {"tma": True}, "dz", 98320),
    (torch.float32, {"tma": True}, "dh", 49168),
    (torch.float32, {"tma": True}, "kl forward", 90136),
    (torch.float32, {"tma": True}, "kl dz", 123904),
    (torch.bfloat16, {"block_m": 256, "block_n": 256, "block_k": 64, "tma": False}, "dz", 196608),
    (torch.float32, {"block_m": 128, "block_n": 128, "block_k": 64}, "forward", 131072),
]

#: Tiles an H200 refused to compile ("out of resource: shared memory"), with what it required.
REFUSED: list[tuple[torch.dtype, dict[str, Any], str, int]] = [
    (torch.bfloat16, {"block_m": 64, "block_n": 64, "block_k": 256}, "kl forward", 262176),
    (torch.bfloat16, {"block_m": 128, "block_n": 128, "block_k": 128}, "kl forward", 262176),
    (torch.bfloat16, {"block_m": 256, "block_n": 128, "block_k": 64}, "kl dz", 263168),
    (torch.bfloat16, {"block_m": 128, "block_n": 256, "block_k": 128}, "forward", 294936),
    (torch.bfloat16, {"block_m": 256, "block_n": 256, "block_k": 64}, "dz", 327704),
    (torch.bfloat16, {"block_m": 64, "block_n": 256, "block_k": 128, "tma": False}, "forward", 245760),
    (torch.float32, {"block_m": 128, "block_n": 128, "block_k": 128}, "forward", 262144),
]  # fmt: skip


def _estimates(dtype: torch.dtype, options: dict[str, Any], *, tma: bool = True) -> dict[str, int]:
    st = settings_for(dtype, **options)
    esize = torch.empty((), dtype=dtype).element_size()
    return {u.kernel: u.nbytes for u in shared_memory_estimates(st, esize, tma=tma)}


@pytest.mark.parametrize("dtype,options,kernel,measured", MEASURED)
def test_the_estimate_bounds_what_an_h200_compiled(dtype, options, kernel, measured):
    est = _estimates(dtype, options)[kernel]
    assert est - SHARED_SLACK <= measured <= est, (est, measured)


@pytest.mark.parametrize("dtype,options,kernel,required", REFUSED)
def test_what_an_h200_refused_is_over_its_limit(dtype, options, kernel, required):
    est = _estimates(dtype, options)
    assert est[kernel] - SHARED_SLACK <= required <= est[kernel]
    st = settings_for(dtype, **options)
    over = shared_memory_excess(st, torch.empty((), dtype=dtype).element_size(), H200, tma=True)
    assert over is not None and over.nbytes > H200


@pytest.mark.parametrize("limit", [H200, A100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_shipped_tiles_fit(dtype, limit):
    """bf16/fp16 128x256x64 in 3 stages (the KL: 128x128x64 in 4, a head at a time), fp32
    64x128x32 in 3; an A100 takes the pointer path (no TMA)."""
    st = settings_for(dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    tma = limit == H200
    assert shared_memory_excess(st, esize, limit, tma=tma) is None
    if dtype != torch.float32:
        est = _estimates(dtype, {}, tma=tma)
        # 3 x (128 + 256) x 64 x 2 B, and the KL's 4 x (128 + 128) x 64 x 2 B (one head's)
        assert est["forward"] == 3 * (128 + 256) * 64 * 2 + SHARED_SLACK
        assert est["kl forward"] == 4 * (128 + 128) * 64 * 2 + SHARED_SLACK


def _cuda_like(monkeypatch: pytest.MonkeyPatch, limit: int, capability: tuple[int, int]) -> None:
    """This process as one CUDA GPU with ``limit`` bytes of opt-in shared memory per block."""
    monkeypatch.setattr(backend_module, "interpret_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    props = SimpleNamespace(name="Simulated GPU", shared_memory_per_block_optin=limit)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)


def test_an_oversized_tile_is_an_options_error_in_check(monkeypatch):
    _cuda_like(monkeypatch, H200, (9, 0))
    head = TritonBackend(TritonOptions(block_m=128, block_n=256, block_k=128))
    with pytest.raises(OptionsError) as info:
        head.check(torch.device("cuda"), torch.bfloat16)
    err, msg = info.value, str(info.value)
    for words in (
        "block_m=128, block_n=256, block_k=128",
        "set by the options block_m=128, block_n=256, block_k=128",
        "3 stages",
        f"more than the {H200} bytes of Simulated GPU (cuda:0, shared_memory_per_block_optin)",
        "361472 bytes",  # dz: 3 x 384 x 128 x 2 + its 128 x 256 x 2 TMA store tile + slack
        "dz kernel",
        "out of resources",
    ):
        assert words in msg, (words, msg)
    assert err.option == "block_k" and "block_k: int or None = None" in err.valid_options
    assert "block_k=64" in (err.hint or "")  # a tile that fits, found by halving block_k
    assert isinstance(err, ValueError)


def test_the_shipped_tiles_pass_check_on_an_h200(monkeypatch):
    _cuda_like(monkeypatch, H200, (9, 0))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        TritonBackend().check(torch.device("cuda"), dtype)
        TritonBackend(TritonOptions(memory="fast")).check(torch.device("cuda"), dtype)


def test_a_small_gpu_refuses_even_the_shipped_16_bit_tile_by_name(monkeypatch):
    _cuda_like(monkeypatch, RTX_3090, (8, 6))
    with pytest.raises(OptionsError) as info:
        TritonBackend().check(torch.device("cuda"), torch.bfloat16)
    msg = str(info.value)
    assert "the shipped bf16 tile: no block_m/block_n/block_k set" in msg, msg
    assert f"more than the {RTX_3090} bytes" in msg and info.value.option is None
    TritonBackend().check(torch.device("cuda"), torch.float32)  # fp32's smaller tile fits
    fit = TritonBackend(TritonOptions(block_k=32))
    fit.check(torch.device("cuda"), torch.bfloat16)


def test_the_interpreter_has_no_limit_to_check():
    # TRITON_INTERPRET=1 here (the conftest): the CPU check never asks for a CUDA property.
    TritonBackend(TritonOptions(block_m=1024, block_n=1024, block_k=1024)).check(
        torch.device("cpu"), torch.float32
    )


@pytest.mark.gpu
def test_on_a_gpu_an_oversized_tile_is_refused_before_triton_compiles():
    from fusedhead import FusedHead

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, generator=g) / 16
    labels = torch.randint(0, 1000, (64,), device="cuda", generator=g)
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    big = FusedHead(backend="triton", options={"block_m": 256, "block_n": 256, "block_k": 256})
    with pytest.raises(
        OptionsError, match=rf"of shared memory per block .* than the {limit} bytes"
    ):
        big(hidden, weight, labels)
    out = FusedHead(backend="triton")(hidden, weight, labels)  # the shipped tiles run
    assert torch.isfinite(out.log_probs).all()
