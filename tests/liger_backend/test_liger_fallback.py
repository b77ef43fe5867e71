"""``implementation="fallback"``: Liger's chunked path against the float64 reference, on the CPU.

N is above Liger's 512-row chunk so the chunk loop is exercised; fp32 errors stay at fp32's
rounding level. Entropy is ``lse - sum(p z)``, a difference of numbers of the logits' size, so its
fp32 error is a few ulps of ``max|z| + |lse|`` per row, however small the entropy itself is.
"""

from __future__ import annotations

import pytest
import torch

from fusedhead import registry
from fusedhead.errors import BackendUnavailableError
from fusedhead.protocol import call_backend
from fusedhead.reference import reference_fused_head

pytest.importorskip(
    "fusedhead_liger",
    reason="the liger backend is not installed (pip install ./plugins/liger_backend)",
)
from fusedhead_liger import LigerBackend, LigerOptions

N, H, V = 700, 48, 1000
IGNORE = -100
FP32_TOL = 2e-6  # relative L2 error of log-probs and gradients; measured at most 4e-7


def fallback() -> LigerBackend:
    return LigerBackend(LigerOptions(implementation="fallback"))


def inputs(seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * scale / H**0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.1] = IGNORE
    return hidden, weight, labels, torch.randn(N, generator=gen), torch.randn(N, generator=gen)


def call(
    backend, hidden, weight, labels, *, temperature=0.7, return_entropy=True, ignore_index=IGNORE
):
    return call_backend(backend,
        hidden, weight, labels, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, process_group=None, vocab_start=0,
        vocab_size=weight.shape[0], reduce_hidden_grad=True,
    )  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def grad_tol(hidden, weight, temperature) -> float:
    """fp32 gradient tolerance: a floor plus 2 ulps of the largest logit (measured: 0.3-0.5 ulps)."""
    zmax = float((hidden.double() @ weight.double().T).abs().max()) / temperature
    return FP32_TOL + 2 * 2.0**-23 * zmax


def assert_entropy_fp32(ent, rent, hidden, weight, temperature) -> None:
    """Per row, |error| <= 8 fp32 ulps of the row's logit scale (measured: at most ~4)."""
    z = hidden.double() @ weight.double().T / temperature
    scale = z.abs().amax(-1) + torch.logsumexp(z, -1).abs()
    ulps = (ent.detach().double() - rent.detach()).abs() / (2.0**-23 * scale)
    assert float(ulps.max()) < 8, f"entropy error {float(ulps.max()):.1f} ulps of the logit scale"


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 20.0])
@pytest.mark.parametrize("return_entropy", [True, False])
def test_forward_and_backward_match_float64(temperature: float, return_entropy: bool) -> None:
    hidden, weight, labels, g_lp, g_ent = inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = call(fallback(), h, w, labels, temperature=temperature, return_entropy=return_entropy)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    rlp, rent = reference_fused_head(
        h64, w64, labels, temperature=temperature, ignore_index=IGNORE,
        return_entropy=return_entropy, compute_dtype=torch.float64,
    )  # fmt: skip
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    assert rel(lp, rlp) < FP32_TOL
    loss, rloss = (lp * g_lp).sum(), (rlp * g_lp).sum()
    if return_entropy:
        assert ent is not None and ent.dtype == torch.float32
        assert_entropy_fp32(ent, rent, hidden, weight, temperature)
        loss, rloss = loss + (ent * g_ent).sum(), rloss + (rent * g_ent).sum()
    else:
        assert ent is None
    dh, dw = torch.autograd.grad(loss, (h, w))
    rdh, rdw = torch.autograd.grad(rloss, (h64, w64))
    tol = grad_tol(hidden, weight, temperature)
    assert rel(dh, rdh) < tol
    assert rel(dw, rdw) < tol


def test_ignored_rows_are_zero_with_zero_gradient() -> None:
    hidden, weight, labels, g_lp, g_ent = inputs()
    h = hidden.clone().requires_grad_()
    lp, ent = call(fallback(), h, weight, labels)
    ignored = labels == IGNORE
    assert ignored.any()
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    (lp * g_lp + ent * g_ent).sum().backward()
    assert (h.grad[ignored] == 0).all()
    assert (h.grad[~ignored].abs().sum(-1) > 0).all()


def test_ignore_index_inside_the_vocabulary() -> None:
    hidden, weight, labels, *_ = inputs()
    labels = labels.clamp_min(0)
    labels[:50] = 3
    lp, ent = call(fallback(), hidden, weight, labels, ignore_index=3)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=0.7, ignore_index=3, compute_dtype=torch.float64
    )
    assert (lp[:50] == 0).all()
    assert rel(lp, rlp) < FP32_TOL and rel(ent, rent) < FP32_TOL


@pytest.mark.parametrize("which", ["hidden", "weight", "neither"])
def test_partial_requires_grad(which: str) -> None:
    hidden, weight, labels, g_lp, g_ent = inputs()
    h = hidden.clone().requires_grad_(which == "hidden")
    w = weight.clone().requires_grad_(which == "weight")
    lp, ent = call(fallback(), h, w, labels)
    if which == "neither":
        assert not lp.requires_grad and not ent.requires_grad
        return
    (lp * g_lp + ent * g_ent).sum().backward()
    leaf, other = (h, w) if which == "hidden" else (w, h)
    assert other.grad is None
    ref_h = hidden.double().requires_grad_(which == "hidden")
    ref_w = weight.double().requires_grad_(which == "weight")
    rlp, rent = reference_fused_head(
        ref_h, ref_w, labels, temperature=0.7, compute_dtype=torch.float64
    )
    (rlp * g_lp + rent * g_ent).sum().backward()
    ref_leaf = ref_h if which == "hidden" else ref_w
    assert rel(leaf.grad, ref_leaf.grad) < FP32_TOL


def test_only_one_output_used_in_backward() -> None:
    hidden, weight, labels, g_lp, g_ent = inputs()
    for use in ("log_probs", "entropy"):
        h = hidden.clone().requires_grad_()
        lp, ent = call(fallback(), h, weight, labels)
        out, g = (lp, g_lp) if use == "log_probs" else (ent, g_ent)
        (dh,) = torch.autograd.grad((out * g).sum(), h)
        h64 = hidden.double().requires_grad_()
        rlp, rent = reference_fused_head(
            h64, weight.double(), labels, temperature=0.7, compute_dtype=torch.float64
        )
        (rdh,) = torch.autograd.grad(((rlp if use == "log_probs" else rent) * g).sum(), h64)
        assert rel(dh, rdh) < FP32_TOL, use


@pytest.mark.parametrize("scale", [4.0, 200.0])
def test_peaked_and_large_magnitude_logits(scale: float) -> None:
    hidden, weight, labels, *_ = inputs(scale=scale)
    lp, ent = call(fallback(), hidden, weight, labels, temperature=1.0)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=1.0, compute_dtype=torch.float64
    )
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert rel(lp, rlp) < FP32_TOL
    assert_entropy_fp32(ent, rent, hidden, weight, 1.0)


def test_all_negative_logits() -> None:
    hidden, weight, labels, *_ = inputs()
    hidden = hidden.abs()
    weight = -weight.abs()
    lp, ent = call(fallback(), hidden, weight, labels)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=0.7, compute_dtype=torch.float64
    )
    assert rel(lp, rlp) < FP32_TOL and rel(ent, rent) < FP32_TOL


def test_out_of_range_label_gives_nan_and_leaves_other_rows_alone() -> None:
    hidden, weight, labels, g_lp, _ = inputs()
    bad = labels.clone()
    bad[7], bad[8], bad[9] = V, V + 10_000, -5
    h = hidden.clone().requires_grad_()
    lp, ent = call(fallback(), h, weight, bad)
    assert torch.isnan(lp[7:10]).all() and torch.isnan(ent[7:10]).all()
    good = torch.ones(N, dtype=torch.bool)
    good[7:10] = False
    clean = labels.clone()
    clean[7:10] = IGNORE
    rlp, rent = reference_fused_head(
        hidden, weight, clean, temperature=0.7, compute_dtype=torch.float64
    )
    assert rel(lp[good], rlp[good]) < FP32_TOL and rel(ent[good], rent[good]) < FP32_TOL
    (lp[good] * g_lp[good]).sum().backward()
    assert torch.isfinite(h.grad).all()


def test_non_contiguous_hidden() -> None:
    hidden, weight, labels, *_ = inputs()
    wide = torch.zeros(N, 2 * H)
    wide[:, ::2] = hidden
    view = wide[:, ::2]
    assert not view.is_contiguous()
    lp, ent = call(fallback(), view, weight, labels)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=0.7, compute_dtype=torch.float64
    )
    assert rel(lp, rlp) < FP32_TOL and rel(ent, rent) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_fp32_outputs_and_gradients_in_the_input_dtype(dtype: torch.dtype) -> None:
    hidden, weight, labels, g_lp, g_ent = inputs(dtype=dtype)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = call(fallback(), h, w, labels)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    (lp * g_lp + ent * g_ent).sum().backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=0.7, compute_dtype=torch.float64
    )
    # Logits and entropy are rounded to the input dtype, as the declared precisions say.
    eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert rel(lp, rlp) < 4 * eps and rel(ent, rent) < 4 * eps


def test_temperature_tensor_and_softcap_are_refused() -> None:
    hidden, weight, labels, *_ = inputs()
    with pytest.raises(BackendUnavailableError, match="per-token"):
        call(fallback(), hidden, weight, labels, temperature=torch.full((N,), 0.7))
    with pytest.raises(BackendUnavailableError, match="softcap"):
        call_backend(fallback(),
            hidden, weight, labels, temperature=1.0, ignore_index=IGNORE, return_entropy=True,
            process_group=None, vocab_start=0, vocab_size=V, reduce_hidden_grad=True, softcap=30.0,
        )  # fmt: skip


def test_n_equal_one_and_odd_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(1, 37, generator=gen), torch.randn(101, 37, generator=gen)
    labels = torch.tensor([100])
    lp, ent = call(fallback(), hidden, weight, labels)
    rlp, rent = reference_fused_head(
        hidden, weight, labels, temperature=0.7, compute_dtype=torch.float64
    )
    assert rel(lp, rlp) < FP32_TOL
    assert_entropy_fp32(ent, rent, hidden, weight, 0.7)


# ----------------------------------------------------------------------------- through the core


@pytest.fixture
def fused_head():
    from fusedhead import api

    registry.refresh()
    return api.fused_head


def test_core_call_3d_matches_reference(fused_head) -> None:
    hidden, weight, labels, g_lp, g_ent = inputs()
    h = hidden.clone().view(2, N // 2, H).requires_grad_()
    out = fused_head(h, weight, labels.view(2, N // 2), backend="liger", temperature=0.7,
                     options={"implementation": "fallback"})  # fmt: skip
    assert out.log_probs.shape == (2, N // 2)
    h64 = hidden.double().requires_grad_()
    rlp, rent = reference_fused_head(
        h64, weight, labels, temperature=0.7, compute_dtype=torch.float64
    )
    assert rel(out.log_probs.reshape(-1), rlp) < FP32_TOL
    assert_entropy_fp32(out.entropy.reshape(-1), rent, hidden, weight, 0.7)
    (out.log_probs.reshape(-1) * g_lp + out.entropy.reshape(-1) * g_ent).sum().backward()
    (rlp * g_lp + rent * g_ent).sum().backward()
    assert rel(h.grad.reshape(N, H), h64.grad) < grad_tol(hidden, weight, 0.7)


def test_core_check_labels_false_out_of_range_is_nan(fused_head) -> None:
    hidden, weight, labels, *_ = inputs()
    labels = labels.clone()
    labels[0] = V + 1
    out = fused_head(hidden, weight, labels, backend="liger", options={"implementation": "fallback"},
                     check_labels=False)  # fmt: skip
    assert torch.isnan(out.log_probs[0])
    assert torch.isfinite(out.log_probs[1:]).all()


def test_ignored_rows_are_positive_zero_bitwise() -> None:
    """``-nll`` made an ignored row's log-prob -0.0; the torch backend and the contract give +0.0."""
    hidden, weight, labels, *_ = inputs()
    lp, ent = call(fallback(), hidden, weight, labels)
    ignored = labels == IGNORE
    assert ignored.any()
    for t in (lp, ent):
        assert (t[ignored] == 0).all() and not torch.signbit(t[ignored]).any()


def test_docs_claim_only_the_declared_devices_and_dtypes() -> None:
    """The fallback was described as running on "any device and dtype"; check() refuses all but
    the CPU and CUDA, and the capabilities declare fp32, fp16 and bf16."""
    import fusedhead_liger.backend as backend_module
    from fusedhead_liger import _liger

    caps = fallback().capabilities(torch.device("cpu"))
    assert caps.devices == ("cpu", "cuda") and caps.dtypes == ("fp32", "fp16", "bf16")
    described = LigerOptions.model_fields["implementation"].description
    texts = (described, backend_module.__doc__, _liger.fallback_function.__doc__)
    for text in texts:
        assert text is not None and "any device" not in text
    assert "CPU or CUDA, fp32/fp16/bf16" in described
    with pytest.raises(BackendUnavailableError, match="runs on \\['cpu', 'cuda'\\], not 'meta'"):
        fallback().check(torch.device("meta"), torch.float32)
