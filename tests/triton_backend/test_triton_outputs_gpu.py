"""On a CUDA GPU: the triton backend's lse, sum_p2, argmax, gather and top-k in bf16/fp16/fp32
against float64 full logits on the same values (outputs and gradients), gathered at the labels
bitwise the log-probs, top-k values bitwise the gathered ones at its ids, batch invariance and
determinism with torch.equal. Skipped with the reason without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from triton_backend_helpers import IGNORE, reads_peak_memory, rel_err

from fusedhead.protocol import HeadCall
from fusedhead.testing.outputs import reference_outputs
from fusedhead_triton import TritonBackend, TritonOptions

pytestmark = pytest.mark.gpu
EXTRAS = frozenset({"lse", "sum_p2", "argmax"})
FLOATS = ("log_probs", "entropy", "lse", "sum_p2", "gathered", "topk_log_probs")
#: (outputs, gradients) relative L2 bounds against float64 (outputs: fp32 statistics of the
#: dtype's values; gradients through dz stored in the dtype, as in test_triton_gpu.py).
TOL = {torch.bfloat16: (1e-5, 5e-3), torch.float16: (1e-5, 1e-3), torch.float32: (1e-5, 1e-5)}


def _inputs(n: int, h: int, v: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(n, h, generator=g, device="cuda").to(dtype)
    w = (torch.randn(v, h, generator=g, device="cuda") / h**0.5).to(dtype)
    lab = torch.randint(0, v, (n,), generator=g, device="cuda")
    lab[1::10] = IGNORE  # row 0 scored: the N = 1 case checks something
    ids = torch.randint(0, v, (n, k), generator=g, device="cuda")
    ids[:, 0] = lab.clamp(min=0)
    if k > 3:
        ids[:, 1] = ids[:, 2]  # a repeated id
        ids[:, -1] = IGNORE
    return hid, w, lab, ids


def _call(
    be: TritonBackend, h: torch.Tensor, w: torch.Tensor, lab: torch.Tensor, ids: Any, k: int,
    temperature: Any = 0.7,
) -> Any:  # fmt: skip
    call = HeadCall.make(
        h, w, lab, temperature=temperature, ignore_index=IGNORE, extras=EXTRAS, gather_ids=ids,
        top_k=k,
    )  # fmt: skip
    return be.forward(call)


def _upstream(out: Any, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        f: torch.randn(getattr(out, f).shape, generator=g, device="cuda")
        for f in FLOATS
        if getattr(out, f) is not None
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("n", "h", "v", "k", "options"),
    [
        (1937, 3584, 152064, 32, {}),
        (4099, 1000, 50257, 256, {}),  # K = 256 gathered ids per row
        (1, 4096, 151936, 32, {}),
        (700, 896, 151937, 7, {"backward_block_mib": 2}),  # odd V, many backward blocks
    ],
)
def test_outputs_against_float64(n, h, v, k, options, dtype) -> None:
    if dtype == torch.float32 and n * v > 2e8:
        pytest.skip("fp32 exact dots are slow; one fp32 shape is enough")
    hid, w, lab, ids = _inputs(n, h, v, k, dtype)
    top_k = min(k, 32)
    temp = torch.rand(n, device="cuda") + 0.5
    be = TritonBackend(TritonOptions(**options))
    hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
    out = _call(be, hh, ww, lab, ids, top_k, temperature=temp)
    ups = _upstream(out, 1)
    loss = sum((getattr(out, f).double() * g.double()).sum() for f, g in ups.items())
    dh, dw = torch.autograd.grad(loss, [hh, ww])
    valid = lab != IGNORE
    hd, wd = hid.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_outputs(
        hd, wd, lab, temperature=temp.double(), ignore_index=IGNORE, gather_ids=ids,
        topk_ids=torch.where(valid.unsqueeze(1), out.topk_ids, 0),
    )  # fmt: skip
    want = sum((ref[f] * g.double()).sum() for f, g in ups.items())
    rdh, rdw = torch.autograd.grad(want, [hd, wd])
    out_tol, grad_tol = TOL[dtype]
    for f in FLOATS:
        if f != "sum_p2":
            assert rel_err(getattr(out, f), ref[f]) <= out_tol, f
    _assert_sum_p2_at_fp32_gemm_precision(out, ref, hid, w, temp, valid)
    assert rel_err(dh, rdh) <= grad_tol and rel_err(dw, rdw) <= grad_tol
    assert dh.dtype == dtype and dw.dtype == dtype
    # Ids: the argmax is the first top-k id; each top-k id's float64 log-prob is within the
    # log-prob error of the true k best (near-ties may swap under the dtype's rounding).
    assert torch.equal(out.argmax[valid], out.topk_ids[valid, 0])
    assert bool((out.argmax[~valid] == -1).all()) and bool((out.topk_ids[~valid] == -1).all())
    logp = ref["logp"].detach()
    best = logp.topk(top_k, dim=1).values
    at = logp.gather(1, out.topk_ids.clamp(min=0))
    assert float((best - at)[valid].abs().max()) <= 1e-4
    assert torch.equal(out.gathered[:, 0], out.log_probs)  # the labels, bitwise
    for f in ("lse", "sum_p2", "gathered", "topk_log_probs"):
        assert bool((getattr(out, f)[~valid] == 0).all()), f


def _assert_sum_p2_at_fp32_gemm_precision(
    out: Any, ref: dict[str, torch.Tensor], hid: torch.Tensor, w: torch.Tensor,
    temp: torch.Tensor, valid: torch.Tensor,
) -> None:  # fmt: skip
    """sum p^2 moves by 2 sum p^2 d(log p) (weighted by p^2), so it carries about twice the
    logits' absolute error, and an fp32-accumulated tensor-core GEMM's logits are off by a few
    1e-6 (on the H200 cuBLAS and the kernel alike shrink them by about 3.7e-6 relative at
    H = 3584): that puts sum p^2 near 5e-5 relative, above the 1e-5 the log-probs meet. So it
    is held to the yardstick of the same precision: float64 sum p^2 of cuBLAS's fp32 logits."""
    got, want = out.sum_p2.double()[valid], ref["sum_p2"].detach()[valid]
    with torch.no_grad():
        z = torch.mm(hid, w.T, out_dtype=torch.float32).double() / temp.double().unsqueeze(1)
        cublas = torch.softmax(z, dim=1).pow(2).sum(1)[valid]
    assert rel_err(got, want) <= 1.25 * rel_err(cublas, want) + 1e-6


def test_gather_is_bitwise_the_log_probs_and_top_k_values_bf16() -> None:
    hid, w, lab, _ = _inputs(3001, 4096, 151936, 1, torch.bfloat16, seed=5)
    be = TritonBackend()
    with torch.no_grad():
        plain = be.forward(HeadCall.make(hid, w, lab, temperature=0.7, ignore_index=IGNORE))
        one = be.forward(
            HeadCall.make(
                hid,
                w,
                lab,
                temperature=0.7,
                ignore_index=IGNORE,
                gather_ids=lab.clamp(min=0).unsqueeze(1),
            )
        )
        top = _call(be, hid, w, lab, None, 32)
        valid = lab != IGNORE
        at = be.forward(
            HeadCall.make(
                hid,
                w,
                lab,
                temperature=0.7,
                ignore_index=IGNORE,
                gather_ids=torch.where(valid.unsqueeze(1), top.topk_ids, 0),
            )
        )
    assert torch.equal(one.gathered[:, 0], plain.log_probs)
    assert torch.equal(one.log_probs, plain.log_probs) and torch.equal(
        top.log_probs, plain.log_probs
    )
    assert torch.equal(at.gathered, top.topk_log_probs)


def test_outputs_batch_invariance_bf16() -> None:
    n = 1500
    hid, w, lab, ids = _inputs(n, 4096, 151936, 32, torch.bfloat16, seed=2)
    be = TritonBackend()
    fields = (*FLOATS, "argmax", "topk_ids")
    with torch.no_grad():
        full = _call(be, hid, w, lab, ids, 32)
        perm = torch.randperm(n, device="cuda")
        for rows in (perm, torch.arange(7, 300, device="cuda"), torch.tensor([0], device="cuda"),
                     torch.tensor([n - 1], device="cuda")):  # fmt: skip
            part = _call(be, hid[rows], w, lab[rows], ids[rows], 32)
            for f in fields:
                assert torch.equal(getattr(part, f), getattr(full, f)[rows]), f
        more, _, lab_m, ids_m = _inputs(3000, 4096, 151936, 32, torch.bfloat16, seed=3)
        big = _call(
            be, torch.cat([more, hid]), w, torch.cat([lab_m, lab]), torch.cat([ids_m, ids]), 32
        )
        for f in fields:
            assert torch.equal(getattr(big, f)[3000:], getattr(full, f)), f


def test_outputs_determinism_bf16() -> None:
    hid, w, lab, ids = _inputs(2048, 4096, 151936, 32, torch.bfloat16, seed=4)
    runs = []
    for _ in range(2):
        hh, ww = hid.clone().requires_grad_(), w.clone().requires_grad_()
        out = _call(TritonBackend(), hh, ww, lab, ids, 32)
        ups = _upstream(out, 9)
        loss = sum((getattr(out, f) * g).sum() for f, g in ups.items())
        runs.append([*(getattr(out, f) for f in (*FLOATS, "argmax", "topk_ids")),
                     *torch.autograd.grad(loss, [hh, ww])])  # fmt: skip
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@reads_peak_memory
def test_gather_forward_memory_is_o_of_n_k_bf16() -> None:
    """The gather's extra forward memory over the plain call: the ids' tables (O(N K) and the
    per-tile starts, ``(T + 1) N`` int32), far below one [N, V] logits tensor."""
    n, h, v, k = 8192, 4096, 151936, 32
    hid, w, lab, ids = _inputs(n, h, v, k, torch.bfloat16, seed=6)
    be = TritonBackend()

    def peak(fn: Any) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain = peak(lambda: be.forward(HeadCall.make(hid, w, lab, ignore_index=IGNORE)))
    gathered = peak(
        lambda: be.forward(HeadCall.make(hid, w, lab, ignore_index=IGNORE, gather_ids=ids))
    )
    tiles = -(-v // be._settings(torch.bfloat16)[0].forward.block_n)
    allowed = 8 * n * k * 8 + (tiles + 1) * n * 4 + 4 * n * 8  # ids, sorts, values; starts; rows
    assert gathered - plain <= allowed, (plain, gathered)


def test_no_rows_gives_empty_outputs_bf16() -> None:
    """N = 0 straight at the backend (the TMA path takes no descriptor of an empty tensor)."""
    hid, w, lab, ids = _inputs(0, 4096, 151936, 8, torch.bfloat16)
    with torch.no_grad():
        out = _call(TritonBackend(), hid, w, lab, ids, 8)
    assert out.log_probs.shape == (0,) and out.topk_ids.shape == (0, 8)
    assert out.gathered.shape == (0, 8) and out.sum_p2.shape == (0,)
