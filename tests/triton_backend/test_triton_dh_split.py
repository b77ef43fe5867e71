"""The bf16 hidden-gradient running sum: bf16 hi (the output itself) + int8 lo.

Contract: a stored pair decodes to its fp32 total within one low step, 2^-14 of |hi| (whether the
fp32 -> bf16 cast rounds to nearest, as on GPUs, or truncates, as Triton's interpreter does), so
a sum over many vocabulary blocks stays far more accurate than the bf16 output it ends in; zeros
decode to zero and values below 2^-100 keep bf16 precision. Runs the package's own ``split_store``/``split_load`` helpers in a
small kernel (under the interpreter on the CPU, compiled on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from fusedhead_triton import launch

split_load = split_store = None  # set by _accumulate


def _accumulate(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the running sum of ``parts[K, n]`` through the pair; (hi, lo, decoded after each step)."""
    import triton
    import triton.language as tl

    # The kernel reads the helpers as globals of this module, from the kernel module built for
    # the current interpreter setting.
    global split_load, split_store
    _, bwd = launch.kernels()
    split_load, split_store = bwd.split_load, bwd.split_store

    @triton.jit
    def kernel(parts_ptr, hi_ptr, lo_ptr, seen_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        for k in tl.static_range(K):
            part = tl.load(parts_ptr + k * n + offs, mask=mask, other=0.0)
            if k == 0:  # noqa: SIM108 - constexpr branch
                total = part
            else:
                total = split_load(hi_ptr + offs, lo_ptr + offs, mask) + part
            split_store(total, hi_ptr + offs, lo_ptr + offs, mask)
            tl.store(
                seen_ptr + k * n + offs, split_load(hi_ptr + offs, lo_ptr + offs, mask), mask=mask
            )

    k, n = parts.shape
    hi = torch.empty(n, dtype=torch.bfloat16, device=parts.device)
    lo = torch.empty(n, dtype=torch.int8, device=parts.device)
    seen = torch.empty(k, n, dtype=torch.float32, device=parts.device)
    kernel[(triton.cdiv(n, 64),)](parts, hi, lo, seen, n, K=k, BLOCK=64)
    return hi, lo, seen


def _parts(k: int, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-30, 30, n, base=2.0, dtype=torch.float64)
    parts = torch.randn(k, n, generator=g, dtype=torch.float64) * scale
    return parts.float().to(device)


def _check(device: str) -> None:
    parts = _parts(12, 1000, device)
    hi, lo, seen = _accumulate(parts)
    # Each stored pair decodes to the fp32 running total of what it decoded before, within 2^-16.
    prev = torch.zeros_like(seen[0], dtype=torch.float64)
    for k in range(parts.shape[0]):
        total = (prev.float() + parts[k]).double()
        err = (seen[k].double() - total).abs()
        assert bool((err <= 2.0**-14 * total.abs()).all()), float((err / total.abs()).max())
        prev = seen[k].double()
    # Over the whole sum the pair is ~2^-15 accurate, where bf16 accumulation is ~2^-9.
    exact = parts.double().sum(0)
    rel = float((seen[-1].double() - exact).norm() / exact.norm())
    bf16_sum = torch.zeros_like(exact, dtype=torch.bfloat16)
    for k in range(parts.shape[0]):
        bf16_sum = (bf16_sum.float() + parts[k]).to(torch.bfloat16)
    bf16_rel = float((bf16_sum.double() - exact).norm() / exact.norm())
    assert rel < 1e-4 and rel < bf16_rel / 20, (rel, bf16_rel)
    # hi is the decoded value cast to bf16 (within one bf16 ulp of it); lo stays inside +-127.
    last = seen[-1].double()
    assert bool(((hi.double() - last).abs() <= 2.0**-7 * last.abs()).all())
    assert int(lo.abs().max()) <= 127


def test_pair_holds_the_running_sum_to_sixteen_bits_in_the_interpreter() -> None:
    _check("cpu")


def test_pair_of_zeros_and_tiny_values_decodes_finitely() -> None:
    parts = torch.tensor([[0.0, 2.0**-120, -(2.0**-110)], [0.0, 2.0**-121, 3 * 2.0**-112]])
    _, lo, seen = _accumulate(parts.contiguous())
    assert bool(torch.isfinite(seen).all())
    assert seen[-1, 0] == 0 and int(lo[0]) == 0
    torch.testing.assert_close(seen[-1].double(), parts.double().sum(0), rtol=2.0**-7, atol=0.0)


@pytest.mark.gpu
def test_pair_holds_the_running_sum_to_sixteen_bits_on_the_gpu() -> None:
    _check("cuda")
