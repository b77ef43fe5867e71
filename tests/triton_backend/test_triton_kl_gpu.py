"""On a CUDA GPU: the triton KL of two heads in bf16/fp16/fp32 against an fp32 full-logits
reference, batch invariance with torch.equal, determinism, the kit's KL property and compile.
Skipped with the reason without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_backend_helpers import IGNORE, reads_peak_memory, rel_err

from fusedhead import fused_kl
from fusedhead.protocol import KLCall
from fusedhead.testing import Outcome, check_property
from fusedhead_triton import TritonBackend, TritonOptions

pytestmark = pytest.mark.gpu


def _heads(n: int, h: int, h_t: int, v: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hs = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    ws = (torch.randn(v, h, generator=g, device="cuda") * 2 / h**0.5).to(dtype)
    ht = torch.randn(n, h_t, generator=g, device="cuda").to(dtype)
    wt = (torch.randn(v, h_t, generator=g, device="cuda") * 3 / h_t**0.5).to(dtype)
    lab = torch.randint(0, v, (n,), generator=g, device="cuda")
    lab[::10] = IGNORE
    return hs, ws, ht, wt, lab


def _reference(hs, ws, ht, wt, lab, t_s, t_t, direction, cap_s=None, cap_t=None) -> torch.Tensor:
    """fp32 full logits of the same values (differentiable in hs, ws)."""

    def logits(h: torch.Tensor, w: torch.Tensor, t: Any, cap: float | None) -> torch.Tensor:
        z = h.float() @ w.float().T
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        return z / (t.unsqueeze(1) if isinstance(t, torch.Tensor) else t)

    ls = torch.log_softmax(logits(hs, ws, t_s, cap_s), -1)
    lt = torch.log_softmax(logits(ht, wt, t_t, cap_t), -1)
    a, b = (lt, ls) if direction == "forward" else (ls, lt)
    return torch.where(lab != IGNORE, (a.exp() * (a - b)).sum(-1), 0.0)


@pytest.mark.parametrize(
    ("dtype", "grad_tol"),
    [(torch.bfloat16, 5e-3), (torch.float16, 1e-3), (torch.float32, 1e-5)],
    ids=["bf16", "fp16", "fp32"],
)
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(
    ("n", "h", "h_t", "v", "options"),
    [
        (1937, 2048, 1536, 50257, {}),
        (1, 4096, 4096, 151936, {}),
        (700, 896, 1001, 32000, {"backward_block_mib": 2}),  # many blocks; pointer loads
    ],
)
def test_accuracy_against_fp32(n, h, h_t, v, options, direction, dtype, grad_tol) -> None:
    if dtype == torch.float32 and n * v > 3e7:
        pytest.skip("fp32 exact dots are slow; two fp32 shapes are enough")
    if dtype == torch.float16 and not options:
        pytest.skip("fp16 shares bf16's kernels but for the dtype: one shape is enough")
    hs, ws, ht, wt, lab = _heads(n, h, h_t, v, dtype)
    t_s = torch.rand(n, device="cuda") + 0.5
    hh, ww = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = fused_kl(hh, ww, ht, wt, lab, direction=direction, backend="triton",
                   temperature=t_s, teacher_temperature=1.3, options=options)  # fmt: skip
    g = torch.randn(n, device="cuda")
    dh, dw = torch.autograd.grad((got * g).sum(), [hh, ww])
    hr, wr = hs.float().requires_grad_(), ws.float().requires_grad_()
    want = _reference(hr, wr, ht, wt, lab, t_s, 1.3, direction)
    rdh, rdw = torch.autograd.grad((want * g).sum(), [hr, wr])
    assert got.dtype == torch.float32 and dh.dtype == dtype and dw.dtype == dtype
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)
    assert rel_err(dh, rdh) <= grad_tol and rel_err(dw, rdw) <= grad_tol
    assert bool((got[lab == IGNORE] == 0).all()) and bool((dh[lab == IGNORE] == 0).all())


def test_softcap_bf16() -> None:
    hs, ws, ht, wt, lab = _heads(1024, 1000, 768, 50257, torch.bfloat16, seed=1)
    call = dict(direction="reverse", backend="triton", temperature=0.7)
    got = fused_kl(hs, ws, ht, wt, lab, softcap=30.0, teacher_softcap=20.0, **call)
    want = _reference(hs, ws, ht, wt, lab, 0.7, 1.0, "reverse", 30.0, 20.0)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_batch_invariance_and_determinism_bf16(direction: str) -> None:
    n = 1500
    hs, ws, ht, wt, lab = _heads(n, 4096, 2048, 151936, torch.bfloat16, seed=2)
    be = TritonBackend()

    def kl(rows: slice | torch.Tensor) -> torch.Tensor:
        call = KLCall(hs[rows], ws, ht[rows], wt, lab[rows] != IGNORE, 0.7, 1.0, direction)
        with torch.no_grad():
            return be.kl(call).kl

    full = kl(slice(None))
    perm = torch.randperm(n, device="cuda")
    assert torch.equal(kl(perm), full[perm])
    assert torch.equal(kl(slice(37, 1100)), full[37:1100])
    for i in (0, 777, n - 1):
        assert torch.equal(kl(slice(i, i + 1)), full[i : i + 1])
    big = torch.cat([hs, hs[:300]]), torch.cat([ht, ht[:300]]), torch.cat([lab, lab[:300]])
    call = KLCall(big[0], ws, big[1], wt, big[2] != IGNORE, 0.7, 1.0, direction)
    with torch.no_grad():
        assert torch.equal(be.kl(call).kl[:n], full)

    def step() -> list[torch.Tensor]:
        hh, ww = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        out = fused_kl(hh, ww, ht, wt, lab, direction=direction, backend="triton")
        out.sum().backward()
        return [out.detach(), hh.grad, ww.grad]

    assert all(torch.equal(a, b) for a, b in zip(step(), step()))


@reads_peak_memory
def test_forward_memory_is_the_chunk_statistics_only() -> None:
    """No [N, V] tensor: the forward's peak beyond the inputs is the 5 x C x N statistics."""
    n, v = 8192, 151936
    hs, ws, ht, wt, lab = _heads(n, 1024, 1024, v, torch.bfloat16, seed=3)
    fused_kl(hs, ws, ht, wt, lab, backend="triton")  # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fused_kl(hs, ws, ht, wt, lab, backend="triton")
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 5 * (v // 512 + 1) * n * 4 + 64 * n * 4, extra


def test_kit_kl_property_bf16() -> None:
    """The kit's KL cases (softcap, per-token T) in bf16; the interpreter runs them in fp32
    (test_triton_kit.py) and fp16 (``fusedhead check triton --dtype fp16 -k kl``)."""
    result = check_property("kl_accuracy", "triton", device="cuda", dtype="bf16")
    assert result.outcome is Outcome.PASS, result.line()


def test_fullgraph_compile_bf16() -> None:
    torch._dynamo.reset()
    hs, ws, ht, wt, lab = _heads(512, 1024, 1024, 32000, torch.bfloat16, seed=4)
    be = TritonBackend(TritonOptions())

    def fn(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return be.kl(KLCall(h, w, ht, wt, lab != IGNORE, 0.7, 1.0, "forward")).kl

    def grads(f: Any) -> list[torch.Tensor]:
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        out = f(h, w)
        out.backward(torch.ones_like(out))
        return [out.detach(), h.grad, w.grad]

    eager = grads(fn)
    compiled = grads(torch.compile(fn, fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
