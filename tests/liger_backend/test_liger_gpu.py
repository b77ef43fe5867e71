"""On an H100/H200 with the CuTe DSL: the adapter gives exactly what Liger gives when called directly."""

from __future__ import annotations

import pytest
import torch

from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import call_backend

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions, availability

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()
NATIVE_REASONS = (
    availability.native_reasons(torch.device("cuda"), torch.bfloat16)
    if HAS_CUDA
    else ["no CUDA device"]
)
needs_native = pytest.mark.skipif(bool(NATIVE_REASONS), reason="; ".join(map(str, NATIVE_REASONS)))
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

N, H, V, T = 1000, 256, 32000, 0.7


def inputs(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::10] = -100
    g = torch.randn(2, N, generator=gen)
    return (
        hidden.to("cuda", dtype),
        weight.to("cuda", dtype),
        labels.cuda(),
        g[0].cuda(),
        g[1].cuda(),
    )


def adapter(backend, h, w, y):
    return call_backend(backend,
        h, w, y, temperature=T, ignore_index=-100, return_entropy=True, process_group=None,
        vocab_start=0, vocab_size=w.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@needs_native
def test_native_bf16_is_bitwise_liger_direct() -> None:
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
        LigerFusedLinearScaledCrossEntropyFunction,
    )

    hidden, weight, labels, g_lp, g_ent = inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = adapter(LigerBackend(), h, w, labels)
    dh, dw = torch.autograd.grad((lp, ent), (h, w), (g_lp, g_ent))
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    nll, ent2 = LigerFusedLinearScaledCrossEntropyFunction.apply(h2, w2, labels, T, -100, 1, True)
    assert ent2.dtype == torch.bfloat16  # what Liger computes, hence entropy_precision="bf16"
    # 0 - nll as the adapter maps it: an ignored row's log-prob is +0.0
    assert torch.equal(bits(lp), bits(0.0 - nll)) and torch.equal(bits(ent), bits(ent2.float()))
    dh2, dw2 = torch.autograd.grad((nll, ent2), (h2, w2), (-g_lp, g_ent.to(ent2.dtype)))
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    torch.testing.assert_close(dh, dh2, rtol=0, atol=0)
    torch.testing.assert_close(dw, dw2, rtol=0, atol=0)


@needs_native
def test_native_out_of_range_label_is_nan() -> None:
    hidden, weight, labels, *_ = inputs()
    labels = labels.clone()
    labels[1], labels[2] = V, -3
    lp, ent = adapter(LigerBackend(), hidden, weight, labels)
    assert torch.isnan(lp[1:3]).all() and torch.isnan(ent[1:3]).all()
    assert torch.isfinite(lp[3:]).all() and torch.isfinite(ent[3:]).all()


@needs_cuda
def test_native_fp32_is_our_clear_error() -> None:
    hidden, weight, labels, *_ = inputs(torch.float32)
    with pytest.raises(BackendUnavailableError, match="bfloat16 only"):
        adapter(LigerBackend(), hidden, weight, labels)


@needs_cuda
def test_fallback_on_gpu_matches_reference() -> None:
    from fusedhead.reference import reference_fused_head

    hidden, weight, labels, *_ = inputs(torch.float32)
    lp, ent = adapter(LigerBackend(LigerOptions(implementation="fallback")), hidden, weight, labels)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=T, compute_dtype=torch.float64
    )
    assert float((lp.double() - rlp).norm() / rlp.norm()) < 1e-5
    assert float((ent.double() - rent).norm() / rent.norm()) < 1e-4
